"""Copies of verl's two ways of loading `custom_reward_function.path` (Apache-2.0, verl's authors), so that
the tests load the reward file exactly as verl does without installing verl. Only type annotations that name
verl's own classes and the docstrings are dropped; `config` is anything with `.get` (and, for the current
loader, `.reward`).

- `load_current`: verl 0.9.1 (the newest release; the same code since 0.7.0), `verl/trainer/ppo/reward.py`
  `get_custom_reward_fn` + `_call_with_kwargs`, and `verl/utils/import_utils.py` `load_module` +
  `load_extern_object`. The file is executed WITHOUT being registered in `sys.modules`, under the name
  `custom_module_<hash of its path>`.
- `load_older`: verl 0.6.1, `verl/trainer/ppo/reward.py` `get_custom_reward_fn` (0.5.0: the same without the
  `sys.modules` look-up first): registered as `custom_module` in `sys.modules` before it is executed.
"""
import importlib
import importlib.util
import inspect
import os
import sys
from functools import partial
from typing import Optional

# ------------------------------------------------------------- verl 0.9.1 verl/trainer/ppo/reward.py


def _call_with_kwargs(raw_fn, extra_kwargs, *args, **kwargs):
    merged_kwargs = {**kwargs, **extra_kwargs}
    return raw_fn(*args, **merged_kwargs)


async def _call_with_kwargs_async(raw_fn, extra_kwargs, *args, **kwargs):
    merged_kwargs = {**kwargs, **extra_kwargs}
    return await raw_fn(*args, **merged_kwargs)


def get_custom_reward_fn_current(config):
    reward_fn_config = config.reward.get("custom_reward_function") or {}
    module_path = reward_fn_config.get("path")
    if not module_path:
        return None

    fn_name = reward_fn_config.get("name")
    assert fn_name is not None

    raw_fn = load_extern_object(module_path=module_path, object_name=fn_name)

    reward_kwargs = dict(reward_fn_config.get("reward_kwargs", {}))
    if not inspect.iscoroutinefunction(raw_fn):
        return partial(_call_with_kwargs, raw_fn, reward_kwargs)
    else:
        return partial(_call_with_kwargs_async, raw_fn, reward_kwargs)


# ------------------------------------------------------------- verl 0.9.1 verl/utils/import_utils.py

PKG_PATH_PREFIX = "pkg://"
FILE_PATH_PREFIX = "file://"


def load_module(module_path: str, module_name: Optional[str] = None) -> object:
    if not module_path:
        return None

    if module_path.startswith(PKG_PATH_PREFIX):
        module_name = module_path[len(PKG_PATH_PREFIX) :].replace("/", ".")
        module = importlib.import_module(module_name)

    else:
        if module_path.startswith(FILE_PATH_PREFIX):
            module_path = module_path[len(FILE_PATH_PREFIX) :]

        if not os.path.exists(module_path):
            raise FileNotFoundError(f"Custom module file not found: {module_path=}")

        # Use the provided module_name for the spec, or derive a unique name to avoid collisions.
        spec_name = module_name or f"custom_module_{hash(os.path.abspath(module_path))}"
        spec = importlib.util.spec_from_file_location(spec_name, module_path)
        if spec is None or spec.loader is None:
            raise ImportError(f"Could not load module from {module_path=}")

        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise RuntimeError(f"Error loading module from {module_path=}") from e

        if module_name is not None:
            import sys

            # Avoid overwriting an existing module with a different object.
            if module_name in sys.modules and sys.modules[module_name] is not module:
                raise RuntimeError(
                    f"Module name '{module_name}' already in `sys.modules` and points to a different module."
                )
            sys.modules[module_name] = module

    return module


def load_extern_object(module_path: str, object_name: str) -> object:
    module = load_module(module_path)

    if not hasattr(module, object_name):
        raise AttributeError(f"Object not found in module: {object_name=}, {module_path=}.")

    return getattr(module, object_name)


# ------------------------------------------------------------- verl 0.6.1 verl/trainer/ppo/reward.py


def get_custom_reward_fn_older(config):
    reward_fn_config = config.get("custom_reward_function") or {}
    file_path = reward_fn_config.get("path")
    if not file_path:
        return None

    function_name = reward_fn_config.get("name")
    assert function_name is not None

    module = sys.modules.get("custom_module", None)
    if module is None:
        if not os.path.exists(file_path):
            raise FileNotFoundError(f"Reward function file '{file_path}' not found.")

        spec = importlib.util.spec_from_file_location("custom_module", file_path)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        try:
            sys.modules["custom_module"] = module
            assert spec.loader is not None
            spec.loader.exec_module(module)
        except Exception as e:
            raise RuntimeError(f"Error loading module from '{file_path}': {e}") from e

    if not hasattr(module, function_name):
        raise AttributeError(f"Reward function '{function_name}' not found in '{module.__file__}'.")

    print(f"using customized reward function '{function_name}' from '{module.__file__}'")
    raw_fn = getattr(module, function_name)

    reward_kwargs = dict(reward_fn_config.get("reward_kwargs", {}))

    if not inspect.iscoroutinefunction(raw_fn):
        return partial(_call_with_kwargs, raw_fn, reward_kwargs)
    else:
        return partial(_call_with_kwargs_async, raw_fn, reward_kwargs)


# ------------------------------------------------------------- the tests' entry


class _Config(dict):
    """verl's DictConfig as the loaders read it: `config.reward.get(...)` (current), `config.get(...)`."""

    @property
    def reward(self):
        return self


def load_reward(path, loader: str = "current", **reward_kwargs):
    """compute_score as verl hands it to its reward manager: `loader` "current" (verl >= 0.7) or "older"."""
    config = _Config(custom_reward_function=dict(path=str(path), name="compute_score",
                                                 reward_kwargs=reward_kwargs))
    if loader == "older":
        sys.modules.pop("custom_module", None)  # verl < 0.7 loads once per process
        return get_custom_reward_fn_older(config)
    return get_custom_reward_fn_current(config)

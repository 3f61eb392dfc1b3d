"""Integrations, beside the five: tau2-bench, TextWorld and the environments' registry, choose mode, verl's
export and reward file, the stages' bookkeeping (caches, checks). Skip them on a first read."""

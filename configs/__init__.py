"""Experiment configs (YAML). The wheel ships this folder as the package `rollout.configs`, so that
`load_config("tiny")` and `rollout bench tiny` find `tiny.yaml` by its name in an installed package."""

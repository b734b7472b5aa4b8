"""Experiment configs (YAML), shipped with the package: `rollout bench` with no path reads tiny.yaml from here."""

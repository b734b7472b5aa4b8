"""Ray actor shells and cluster plumbing. The only package that imports ray."""

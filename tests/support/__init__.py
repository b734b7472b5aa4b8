"""Helpers of the test tiers (fakes, drivers, shared inputs, fixtures): imported from here, never from a test module."""

"""Preconditions: GPU inventory (NVML or simulated), port checks, holder attribution."""

"""The simulated noise: perturbed arithmetic and the runs and wider passes made with it."""

"""Loading the model: its config, weightless skeleton, checkpoint, streaming and step functions."""

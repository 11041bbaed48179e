"""A trained model loaded for generation and export, without training state."""

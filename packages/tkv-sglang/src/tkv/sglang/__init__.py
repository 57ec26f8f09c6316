"""tkv.sglang."""

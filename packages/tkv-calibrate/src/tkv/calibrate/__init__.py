"""tkv.calibrate."""

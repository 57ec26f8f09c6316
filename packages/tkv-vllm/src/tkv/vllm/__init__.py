"""tkv.vllm."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class ByteTokenizer:
    """A tiny stand-in for a Hugging Face tokenizer: one token per byte (vocab 256)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def tiny_llama(layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=1024, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).eval()
    # Give K an outlier channel, as real models have after RoPE, so scales have work to do.
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.k_proj.weight[3::32] *= 6.0
    return m


@pytest.fixture(scope="session")
def tiny():
    from tkv.calibrate.model import from_model

    return from_model(tiny_llama(), ByteTokenizer(), "tiny-llama")


@pytest.fixture(scope="session")
def windows():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (6, 64), generator=g)


@pytest.fixture(scope="session")
def calibration(tiny, windows):
    from tkv.calibrate.calibrate import fit_calibration

    return fit_calibration(tiny.model, tiny.geometry, windows[:3], show_progress=False)

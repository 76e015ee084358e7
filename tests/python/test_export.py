"""zoffload.export_safetensors: a checkpoint's fp32 masters as safetensors, read back by the
real safetensors package and by transformers' from_pretrained."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import zoffload  # noqa: E402
import zoffload.torch as zt  # noqa: E402


def test_export_is_read_by_safetensors_and_transformers(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
              "bf16": {"enabled": True}}
    opt = zt.OffloadOptimizer(model.named_parameters(), config, lr=1e-2)
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    opt.save(tmp_path / "ckpt")
    out = tmp_path / "hf"
    out.mkdir()
    cfg.save_pretrained(out)
    zoffload.export_safetensors(tmp_path / "ckpt", out / "model.safetensors")

    masters = {name: s["master"] for name, s in opt.state_dict()["state"].items()}
    tensors = safetensors_torch.load_file(out / "model.safetensors")
    assert set(tensors) == set(masters)
    for name, p in model.named_parameters():
        assert tensors[name].dtype == torch.float32 and tensors[name].shape == p.shape, name
        assert torch.equal(tensors[name].flatten(), masters[name]), name
    # The trained masters differ from the bf16 parameters they started as, and the model now
    # holds them rounded to bf16.
    assert torch.equal(tensors["lm_head.weight"].to(torch.bfloat16), model.lm_head.weight.detach())

    loaded = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), tensors[name]), name

    with pytest.raises(zoffload.AlreadyExists, match="overwrite"):
        zoffload.export_safetensors(tmp_path / "ckpt", out / "model.safetensors")
    with pytest.raises(zoffload.NotFound, match="manifest.json"):
        zoffload.export_safetensors(str(tmp_path / "absent"), str(tmp_path / "x.safetensors"))

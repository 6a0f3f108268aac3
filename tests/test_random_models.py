"""eval/random_models.py: random-weight targets of a named shape as loadable folders whose weights are holes
in sparse files (no disk blocks), filled at random after loading."""

from __future__ import annotations

import json
import os

import torch


def small_config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def test_sparse_folder_loads_and_decodes(tmp_path, monkeypatch):
    import eval.random_models as rm
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.config import TreeConfig

    monkeypatch.setattr(rm, "SHARD_BYTES", 64 << 10)  # several shards for a small model
    target = rm.write_target_folder(small_config(), tmp_path / "t", torch.float32)
    head = rm.write_head_folder(target, tmp_path / "h", torch.float32)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    on_disk = sum(os.stat(target / f).st_blocks * 512 for f in files)
    assert on_disk < sum(os.path.getsize(target / f) for f in files) / 2  # sparse: holes, not zeros
    gen = SpeculativeGenerator.load(target, head=head, device="cpu", dtype="float32",
                                    tree=TreeConfig(total_tokens=12, depth=3, top_k=3, draft_vocab=256))
    assert all(float(p.abs().sum()) == 0 for p in gen.engine.model.parameters() if p.dim() > 1)
    rm.randomize(gen)
    assert all(float(p.abs().sum()) > 0 for p in gen.engine.model.parameters() if p.dim() > 1)
    ids = rm.prompt_ids("a prompt of six words in all", 1024)
    assert len(ids) == 7 and all(256 <= i < 1024 for i in ids)
    r = gen.generate(ids, 8, chat=False)
    assert r.stats.new_tokens == 8 and len(set(r.token_ids)) > 1


def test_real_shapes_are_described_without_memory(tmp_path):
    import eval.random_models as rm
    from fsd_eagle.models import check_target_weights

    for name, shape in rm.SHAPES.items():
        folder = rm.write_target_folder(shape(), tmp_path / name)
        check_target_weights(folder, shape())
        total = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
        assert total > (14 << 30)  # >= 7B parameters in bf16
        assert sum(f.stat().st_blocks for f in folder.iterdir()) * 512 < (16 << 20)

"""Sharding rules, memory plans and the `plan` command; the sharded runs themselves
need 8 devices and run in their own pytest session (tests/multidevice/)."""

import json
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from eqx_models import CausalLM, from_pretrained, supported_model_types
from eqx_models.axes import AbstractHasArrayAxes
from eqx_models.cli import main
from eqx_models.memory import memory_plan
from eqx_models.models import architecture_for
from eqx_models.sharding import (
    Placement,
    ShardingRules,
    head_counts,
    parse_mesh_shape,
    partition_spec,
    placement_for,
    logical_axes,
    resolve_rules,
)
from conftest import REPO, tiny_config
from test_published_configs import QWEN3_30B_A3B
from zoo import tiny_overrides


def test_sharded_runs_on_eight_cpu_devices():
    """tests/multidevice/check_sharding.py in a session with 8 XLA CPU devices: every
    preset equals one device, shardings and shard shapes, compile counts, plans."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=check_*.py",
         str(REPO / "tests" / "multidevice")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    # A crash's own lines (faulthandler's "Fatal Python error" and the stack under
    # it) come first in stderr; the tail alone shows only pytest's outer frames.
    crash = result.stderr.find("Fatal Python error")
    errors = result.stderr[crash:crash + 3000] if crash >= 0 else result.stderr[-3000:]
    assert result.returncode == 0, result.stdout[-6000:] + errors
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary


def test_a_split_needs_a_mesh_axis_that_divides_and_is_not_taken():
    rules = ShardingRules.from_mapping({"batch": ("data", "fsdp"), "kv_heads": "tensor", "mlp": "tensor"})
    sizes = {"data": 2, "fsdp": 4, "tensor": 4}
    assert partition_spec(("batch", None), (8, 3), rules, sizes) == P(("data", "fsdp"))
    assert partition_spec(("batch", None), (2, 3), rules, sizes) == P("data")  # fsdp does not divide 2 rows
    assert partition_spec(("batch", None), (1, 3), rules, sizes) == P()  # one row: replicated
    assert partition_spec(("kv_heads", "mlp"), (2, 8), rules, sizes) == P(None, "tensor")  # 2 heads over 4
    assert partition_spec(("mlp", "mlp"), (8, 8), rules, sizes) == P("tensor")  # a mesh axis splits one axis
    assert partition_spec(("layers", "mlp"), (3, 8), rules, sizes) == P(None, "tensor")


def test_heads_are_never_cut_in_half():
    hf = dict(QWEN3_30B_A3B, num_attention_heads=6, num_key_value_heads=2)
    config = architecture_for(hf).config_from_hf(hf)
    placement = Placement(jax.sharding.AbstractMesh((4,), ("tensor",)), resolve_rules(None), head_counts(config))
    # 6 heads x 128 = 768 rows divide by 4, but 6 heads do not: q_proj stays whole.
    assert placement.spec(("layers", "heads", "embed"), (48, 768, 2048)) == P()
    assert placement.spec(("layers", "mlp", "embed"), (48, 6144, 2048)) == P(None, "tensor")


def test_a_quantized_weight_splits_by_whole_groups():
    from eqx_models.quantization import quantize
    from eqx_models.sharding import partition_specs, per_device_bytes

    hf = tiny_config("qwen3", hidden_size=64, intermediate_size=256, head_dim=16).to_diff_dict()
    config = architecture_for(hf).config_from_hf(hf)
    model = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    quantized = eqx.filter_eval_shape(lambda m: quantize(m, bits=4, group_size=64, mode="affine"), model)
    placement = Placement(jax.sharding.AbstractMesh((4,), ("tensor",)), resolve_rules(None), head_counts(config))
    specs = partition_specs(quantized, placement)
    down, up = specs.model.layers.mlp.down_proj.weight, specs.model.layers.mlp.up_proj.weight
    # down_proj's 256 inputs are 4 groups: one a device, integers, scales and biases alike.
    assert down.packed == down.scales == down.biases == P(None, None, "tensor")
    assert up.packed == up.scales == up.biases == P(None, "tensor")
    # o_proj's 64 inputs are one group: not split along the input, though 32 bytes would divide.
    o_proj = specs.model.layers.self_attn.o_proj.weight
    assert o_proj.packed == o_proj.scales == P()
    assert 0 < per_device_bytes(quantized, placement) < per_device_bytes(model, placement)


def is_axes(x) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_array_of_every_architecture_has_logical_axes(model_type):
    """Walks the parameters and the cache of each registered architecture (its tiny
    config): every array has axes, one name per dimension, declared by its module."""
    hf = tiny_config(model_type, **tiny_overrides(model_type)).to_diff_dict()
    config = architecture_for(hf).config_from_hf(hf)
    model = eqx.filter_eval_shape(CausalLM, config, key=jax.random.key(0))
    caches = [jax.eval_shape(lambda: CausalLM(config, key=jax.random.key(0)).init_cache(2, 16, dtype=dtype))
              for dtype in (None, "int8")]
    for tree in (model, *caches):
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        axes = jax.tree.leaves(logical_axes(tree), is_leaf=is_axes)
        assert len(axes) == len(leaves) > 0
        for (path, leaf), names in zip(leaves, axes):
            assert is_axes(names) and len(names) == len(leaf.shape), (path, names, leaf.shape)
    stacked = jax.tree.leaves(logical_axes(model).model.layers, is_leaf=is_axes)
    assert all(names[0] == "layers" for names in stacked)


def test_axes_come_from_the_modules_that_hold_the_arrays():
    hf = tiny_config("qwen3_moe", **tiny_overrides("qwen3_moe")).to_diff_dict()
    model = eqx.filter_eval_shape(CausalLM, architecture_for(hf).config_from_hf(hf), key=jax.random.key(0))
    axes = logical_axes(model)
    assert axes.model.layers.mlp.sparse.experts.down_proj.weight == ("layers", "experts", "embed", "mlp")
    assert axes.model.layers.mlp.sparse.gate.weight == ("layers", "router", "embed")
    assert axes.model.layers.self_attn.q_norm.weight == ("layers", "head_dim")
    assert axes.lm_head.weight == ("vocab", "embed")

    class Sinks(eqx.Module):  # an array its module declares nothing for
        sinks: jax.Array

    with pytest.raises(ValueError, match="No logical axes declared for the array at sinks"):
        logical_axes(Sinks(jnp.zeros(4)))

    class Wrong(AbstractHasArrayAxes):
        weight: jax.Array

        def array_axes(self):
            return {"weight": ("embed",)}

    with pytest.raises(ValueError, match=r"weight has shape \(2, 3\) but its logical axes are \('embed',\)"):
        logical_axes(Wrong(jnp.zeros((2, 3))))


def test_bad_meshes_and_rules_are_refused(tmp_path):
    with pytest.raises(ValueError, match="Mesh axis names \\['model'\\] are not known"):
        placement_for(None, jax.make_mesh((1,), ("model",)))
    with pytest.raises(ValueError, match="Unknown sharding preset 'zero3'"):
        ShardingRules.preset("zero3")
    with pytest.raises(ValueError, match="sharding= needs mesh="):
        from_pretrained(tmp_path, sharding="tp")
    with pytest.raises(ValueError, match="Bad mesh axis 'tensr=4'"):
        parse_mesh_shape("tensor=2,tensr=4")
    with pytest.raises(ValueError, match="Bad mesh axis 'tensor=0'"):
        parse_mesh_shape("tensor=0")
    assert parse_mesh_shape("tensor=4, expert=2") == {"tensor": 4, "expert": 2}


def test_plan_command_prints_the_per_device_memory(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    assert main(["plan", str(tmp_path), "--mesh", "tensor=4,expert=2", "--json",
                 "--batch-size", "8", "--max-length", "4096"]) == 0
    printed = json.loads(capsys.readouterr().out)
    config = architecture_for(QWEN3_30B_A3B).config_from_hf(QWEN3_30B_A3B)
    assert printed == memory_plan(config, {"tensor": 4, "expert": 2}, dtype=jnp.bfloat16, batch_size=8, max_length=4096)
    assert printed["parameter_bytes"] == 30_532_122_624 * 2  # the published parameter count, bfloat16
    # Everything large is split 8 ways; only norms, router and KV-head-sized leftovers repeat.
    assert printed["parameter_bytes"] / 8 < printed["parameter_bytes_per_device"] < printed["parameter_bytes"] / 7.5
    assert printed["cache_bytes_per_device"] * 8 <= printed["cache_bytes"] * 1.001
    assert main(["plan", str(tmp_path), "--mesh", "expert=4"]) == 0
    text = capsys.readouterr().out
    assert "on 4 devices (expert=4)" in text and "per device" in text
    assert main(["plan", str(tmp_path), "--mesh", "model=2"]) == 2
    assert "Bad mesh axis 'model=2'" in capsys.readouterr().err


def test_a_device_block_is_read_from_the_file_in_place(tmp_path, monkeypatch):
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from eqx_models import safetensors_file

    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((12, 10)).astype(np.float32),
               "b": rng.standard_normal((6, 4, 5)).astype(ml_dtypes.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    source = safetensors_file.TensorSource([tmp_path / "model.safetensors"])
    reads = []
    original = safetensors_file.SafetensorsFile.read_into
    monkeypatch.setattr(safetensors_file.SafetensorsFile, "read_into",
                        lambda self, name, out, rows=None: (reads.append((name, rows)), original(self, name, out, rows)))
    monkeypatch.setattr(safetensors_file, "PART_CHUNK_BYTES", 3 * 10 * 4)  # three rows of w at a time

    out = np.empty((4, 10), np.float32)
    source.read_part_into("w", [range(4, 8), range(0, 10)], out)  # whole rows: one read of those rows
    np.testing.assert_array_equal(out, tensors["w"][4:8])
    assert reads == [("w", range(4, 8))]

    reads.clear()
    out = np.empty((7, 5), np.float32)
    source.read_part_into("w", [range(2, 9), range(5, 10)], out)  # half of each row, in chunks
    np.testing.assert_array_equal(out, tensors["w"][2:9, 5:10])
    assert reads == [("w", range(2, 5)), ("w", range(5, 8)), ("w", range(8, 9))]

    out = np.empty((2, 4, 2), np.float32)  # bfloat16 on disk, float32 wanted
    source.read_part_into("b", [range(1, 3), range(0, 4), range(3, 5)], out)
    np.testing.assert_array_equal(out, tensors["b"][1:3, :, 3:5].astype(np.float32))


def test_a_mesh_of_the_wrong_size_is_refused_with_the_sizes():
    from eqx_models.sharding import device_mesh

    count = jax.device_count()
    with pytest.raises(ValueError, match=f"tensor=2 x data={count} has {2 * count} devices but {count} are here"):
        device_mesh({"tensor": 2, "data": count})
    assert device_mesh({"data": count}).shape == {"data": count}

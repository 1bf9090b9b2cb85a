"""``benchmarks/speed_vs_stock.py``: its FLOP count against torch's own counter, its profiler
counts against a step with known reads, and one smoke run end to end (``--quick``).

The benchmark's timings are measurements, never asserted here; what is asserted is that
the figures it derives them with are right.
"""
import json
import subprocess
import sys

import pytest
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from fairseq_cli_utils import REPO, TINY_MODEL, env
from model_utils import build, sample_batch

sys.path.insert(0, str(REPO / "benchmarks"))
from speedbench import flops, probe  # noqa: E402


@pytest.mark.parametrize("arch,extra", [
    ("transformer", []),
    ("admin_transformer", ["--admin-omega", "parameter"]),
    ("admin_transformer", ["--admin-residual", "resi-dual"]),
])
@pytest.mark.parametrize("bsz,src_len,tgt_len", [(3, 7, 5), (2, 11, 13)])
def test_forward_macs_equal_torchs_flop_counter(tiny_data, arch, extra, bsz, src_len, tgt_len):
    """The shape formula counts every matrix product of a forward pass: torch's
    FlopCounterMode (mm, addmm, bmm, attention) on the real model gives 2 x the MACs."""
    model, task, args = build(tiny_data, arch, TINY_MODEL + extra)
    model.eval()
    src, lengths, prev = sample_batch(task, bsz=bsz, src_len=src_len, tgt_len=tgt_len)
    # torch's counter has no entry for the CPU kernel of scaled_dot_product_attention (the
    # self-attentions' path): give it torch's own formula for the GPU kernels
    cpu_sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    mapping = {cpu_sdpa: lambda q, k, v, *args, out_shape=None, **kwargs:
               flop_counter.sdpa_flop_count(q, k, v)}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter, torch.no_grad():
        model(src, lengths, prev)
    dims = flops.Dims(args.encoder_layers, args.decoder_layers, args.encoder_embed_dim,
                      args.encoder_ffn_embed_dim, len(task.target_dictionary))
    assert counter.get_total_flops() == 2 * flops.forward_macs(dims, bsz, src_len, tgt_len)
    assert flops.train_flops(dims, bsz, src_len, tgt_len) == \
        6 * flops.forward_macs(dims, bsz, src_len, tgt_len)


def test_profiler_counts_ops_and_host_reads():
    x = torch.randn(8, 8)

    def step():
        y = torch.mm(x, x).relu()
        float(y.sum())          # one read
        if bool((y > 100).any()):  # another
            y.add_(1)

    counts = probe.count_step(step, cuda=False)
    assert counts["host_reads"] == 2
    # mm, relu, sum, _local_scalar_dense's caller item, gt, any, is_nonzero: top level only
    assert counts["aten_ops"] == 7


def test_cpu_peak_memory_sees_the_step_allocations():
    def step():
        a = torch.empty(1 << 20)          # 4 MiB
        b = torch.empty(1 << 21)          # 8 MiB while a is alive
        del a, b

    peak = probe.peak_memory(step, cuda=False, steps=1)
    assert peak == 12 * 2 ** 20


def test_quick_run_prints_and_writes_every_variant(tiny_data, tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "speed_vs_stock.py"), "--data", str(tiny_data),
         "--quick", "--threads", "1", "--json", str(out), "--variants",
         # the default variants, then Peri-LN, Mix-LN and DyT (named: not in the default set)
         "admin,admin-buffer,b2t,resi-dual,pre-ln,peri-ln,mix-ln,pre-ln-dyt"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(out.read_text())
    (result,) = summary["results"]
    variants = [r["variant"] for r in result["rows"]]
    assert variants == ["stock", "admin", "admin-buffer", "b2t", "resi-dual", "pre-ln",
                        "peri-ln", "mix-ln", "pre-ln-dyt"]
    for r in result["rows"]:
        assert r["step_ms"] > 0 and r["words_per_s"] > 0 and 0 < r["mfu"]
        assert r["aten_ops"] > 100 and r["peak_mib"] > 0
    by = {r["variant"]: r for r in result["rows"]}
    # the plugin's models skip stock fairseq's per-step padding checks and per-parameter loops
    assert by["admin"]["host_reads"] < by["stock"]["host_reads"]
    assert by["admin"]["aten_ops"] < by["stock"]["aten_ops"]
    assert "| admin |" in proc.stdout and "admin / stock: words/s" in proc.stdout
    for v in ("peri-ln", "mix-ln", "pre-ln-dyt"):
        ratio = by[v]["words_per_s"] / by["stock"]["words_per_s"]
        assert f"{v} / stock: words/s {ratio:.3f}" in proc.stdout
    assert "pre-ln-dyt / pre-ln (DyT's cost over LayerNorm): words/s" in proc.stdout

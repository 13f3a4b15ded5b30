"""`minillm quantize`: bit-identical to llama-quantize, crash-safe, llama.cpp's type rules.

Fast tests use small synthetic data and models; tests marked slow quantize SmolLM2 and compare
every tensor's bytes (sha256) with llama-quantize's output (tests/data/quant_smollm2_dev.json).
"""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import gguf
import numba
import numpy as np
import pytest

from conftest import DATA, REPORT, model_path
from synthetic import SyntheticModel

import minillm
from minillm.errors import MinillmError
from minillm.formats import FORMATS_BY_NAME as FMT
from minillm.gguf_file import GGUFFile
from minillm.kernels.cpu import quantize as Q
from minillm.kernels.cpu import quantize_scalar as QS
from minillm.kernels.cpu.unpack import dequantize
from minillm.quantize import quantize
from minillm.quantize.plan import use_more_bits
from minillm.quantize.writer import TMP_TAG

GOLDEN = json.loads((DATA / "quant_smollm2_dev.json").read_text())
LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# relative RMS round-trip error allowed on Gaussian data (measured values times about 1.3)
ROUND_TRIP_RMS = {"Q8_0": 0.007, "Q6_K": 0.024, "Q5_0": 0.056, "Q5_1": 0.05, "Q5_K": 0.048,
                  "Q4_0": 0.112, "Q4_1": 0.102, "Q4_K": 0.093, "Q3_K": 0.2, "Q2_K": 0.385,
                  "F16": 0.0003, "BF16": 0.0022, "F32": 0.0}


def edge_rows(cols: int, rows: int = 48, seed: int = 0) -> np.ndarray:
    """Gaussian rows plus the cases quantizers trip over: zeros, constants, one spike, ties,
    all-positive and all-negative rows, tiny values, heavy tails."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    x[0] = 0
    x[1, :64] = 0.25
    x[2, 5] = 3.0
    x[3] = rng.integers(-4, 5, cols) * np.float32(0.125)
    x[4] = np.abs(x[4])
    x[5] = -np.abs(x[5])
    x[6] = x[6] * np.float32(1e-18)
    x[7, ::3] = 0
    x[8:16] = rng.standard_t(2, (8, cols)) * 0.02
    return x


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------
def test_fp16_conversion_rounds_to_nearest_even():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 500_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    special = np.array([0.0, -0.0, 65504, 65519.99, 65520, -65520, 2**-14, 2**-24, 2**-25, 3 * 2**-26,
                        6.1e-5, 1e-10, np.inf, -np.inf], np.float32)
    x = np.concatenate([x[np.isfinite(x)], special, rng.standard_normal(100_000).astype(np.float32) * 1e-4])
    out = np.empty((1, x.size), np.uint16)
    Q.convert_f16(x.reshape(1, -1), Q.SRC_F32, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out[0], x.astype(np.float16).view(np.uint16))


def test_bf16_conversion_matches_gguf_reference():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)].reshape(1, -1)
    ours = Q.quantize_rows(FMT["BF16"], x)
    assert np.array_equal(ours, gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16))


@numba.njit
def _scalar_ops(x, nearest, rounded):
    for i in range(x.size):
        nearest[i] = QS.nearest_int(x[i])
        rounded[i] = QS._roundf(x[i])


def test_nearest_int_and_roundf_follow_c():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-300, 300, 100_000), np.arange(-20, 20) + 0.5,
                        rng.uniform(-1e9, 1e9, 1000)]).astype(np.float32)
    nearest, rounded = np.empty(x.size, np.int32), np.empty(x.size, np.float32)
    _scalar_ops(x, nearest, rounded)
    # nearest_int: (bits of x + 1.5*2^23) & 0x7fffff - 0x400000, i.e. round half to even in range
    expected = ((x + np.float32(12582912.0)).view(np.int32) & 0x7FFFFF) - 0x400000
    assert np.array_equal(nearest, expected)
    small = np.abs(x) < 2**22
    assert np.array_equal(nearest[small], np.rint(x[small]).astype(np.int32))
    # roundf: halves away from zero
    away = np.sign(x) * np.floor(np.abs(x.astype(np.float64)) + 0.5)
    assert np.array_equal(rounded, away.astype(np.float32))


@pytest.mark.parametrize("fmt", LEGACY)
def test_legacy_formats_bit_exact_with_gguf_reference(fmt):
    x = edge_rows(512)
    reference = gguf.quants.quantize(x, gguf.GGMLQuantizationType[fmt])
    assert np.array_equal(Q.quantize_rows(FMT[fmt], x), reference)


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_lanes_match_the_scalar_port(fmt):
    """The vectorized fits (groups as lanes) give the scalar port's bytes, including rows
    that fall back to the scalar code (non-finite values)."""
    x = edge_rows(1024)
    x[16, 7] = np.nan
    x[17, :40] = np.inf
    fast = Q.quantize_rows(FMT[fmt], x)
    ref = np.empty_like(fast)
    kernel, _ = Q.KERNELS[fmt]
    kernel(x, Q.SRC_F32, ref, False)                         # use_lanes=False: the scalar port
    assert np.array_equal(fast, ref)


@pytest.mark.parametrize("fmt", sorted(ROUND_TRIP_RMS))
def test_round_trip_error(fmt):
    x = (np.random.default_rng(4).standard_normal((32, 1024)) * 0.05).astype(np.float32)
    y = dequantize(FMT[fmt], Q.quantize_rows(FMT[fmt], x), 1024)
    rel_rms = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert rel_rms <= ROUND_TRIP_RMS[fmt]
    zero = dequantize(FMT[fmt], Q.quantize_rows(FMT[fmt], np.zeros((2, 512), np.float32)), 512)
    assert not zero.any()


def test_every_f16_bit_pattern_decodes_exactly():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(2, -1)
    out = np.empty((2, 32768), np.float32)
    Q.convert_f32(bits, Q.SRC_F16, out)
    assert np.array_equal(out.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_K", "Q6_K", "F16", "BF16"])
def test_f16_and_bf16_sources_are_decoded_exactly(fmt):
    x = edge_rows(512)[16:]
    h = x.astype(np.float16)
    b = (x.view(np.uint32) >> 16).astype(np.uint16)
    from_f16 = Q.quantize_rows(FMT[fmt], h.view(np.uint16), Q.SRC_F16)
    from_bf16 = Q.quantize_rows(FMT[fmt], b, Q.SRC_BF16)
    assert np.array_equal(from_f16, Q.quantize_rows(FMT[fmt], h.astype(np.float32)))
    assert np.array_equal(from_bf16, Q.quantize_rows(FMT[fmt], (b.astype(np.uint32) << 16).view(np.float32)))


# ---------------------------------------------------------------------------------------------
# synthetic models
# ---------------------------------------------------------------------------------------------
def synthetic(tmp_path, fmt="F16", name="model.gguf", untied=False, **dims):
    shape = dict(n_layer=8, n_embd=256, n_head=4, n_head_kv=1, head_dim=64, n_ff=512, n_vocab=300)
    shape.update(dims)
    m = SyntheticModel("llama", fmt, **shape).build()
    if untied:
        m.add("output.weight", shape["n_vocab"], shape["n_embd"])
    return m.write(tmp_path / name)


@pytest.fixture
def model_f16(tmp_path):
    return synthetic(tmp_path)


def types_of(summary) -> dict:
    return {t.name: t.dst.name for t in summary.tensors}


def test_q4_k_m_mixture_follows_llama_cpp(model_f16):
    types = types_of(quantize(model_f16, None, "Q4_K_M", dry_run=True))
    for il in range(8):
        more = "Q6_K" if use_more_bits(il, 8) else "Q4_K"
        assert types[f"blk.{il}.attn_v.weight"] == more
        assert types[f"blk.{il}.ffn_down.weight"] == more
        for other in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{il}.{other}.weight"] == "Q4_K"
        assert types[f"blk.{il}.attn_norm.weight"] == "F32"
    assert [il for il in range(8) if use_more_bits(il, 8)] == [0, 3, 6, 7]
    assert types["token_embd.weight"] == "Q6_K"      # tied embeddings are quantized like output.weight
    assert types["output_norm.weight"] == "F32"


def test_untied_output_gets_q6_k_and_embeddings_the_default(tmp_path):
    types = types_of(quantize(synthetic(tmp_path, untied=True), None, "Q4_K_M", dry_run=True))
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    types = types_of(quantize(synthetic(tmp_path, untied=True), None, "Q8_0", dry_run=True))
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "Q8_0"


def test_rows_not_divisible_by_256_fall_back(tmp_path):
    path = synthetic(tmp_path, n_embd=160, n_head=5, head_dim=32, n_ff=256)
    summary = quantize(path, None, "Q4_K_M", dry_run=True)
    types = types_of(summary)
    assert types["blk.0.attn_q.weight"] == "Q5_0"            # Q4_K -> Q5_0
    assert types["blk.0.attn_v.weight"] == "Q8_0"            # Q6_K -> Q8_0
    assert types["blk.1.attn_v.weight"] == "Q5_0"
    assert types["blk.0.ffn_down.weight"] == "Q6_K"          # 256 columns: no fallback
    assert types["token_embd.weight"] == "Q8_0"              # output rule: not divisible -> Q8_0
    assert summary.n_fallback == 8 * 6                        # attn_q/k/v/output, ffn_gate/up per layer
    types = types_of(quantize(path, None, "Q5_K_S", dry_run=True))
    assert types["blk.2.attn_q.weight"] == "Q5_1"
    types = types_of(quantize(path, None, "Q3_K_S", dry_run=True))
    assert types["blk.2.attn_q.weight"] == "Q4_0"


def test_pure_and_type_overrides(tmp_path):
    path = synthetic(tmp_path, untied=True)
    types = types_of(quantize(path, None, "Q4_K_M", pure=True, dry_run=True))
    assert {t for n, t in types.items() if not n.endswith("norm.weight")} == {"Q4_K"}
    types = types_of(quantize(path, None, "Q4_K_M", tensor_types=["attn_v=q8_0", "BLK\\.1\\.=Q5_K"],
                              output_tensor_type="q8_0", token_embedding_type="F16", dry_run=True))
    assert types["blk.0.attn_v.weight"] == "Q8_0" and types["blk.1.attn_v.weight"] == "Q8_0"
    assert types["blk.1.attn_q.weight"] == "Q5_K" and types["blk.2.attn_q.weight"] == "Q4_K"
    assert types["output.weight"] == "Q8_0" and types["token_embd.weight"] == "F16"
    types = types_of(quantize(path, None, "Q4_0", leave_output_tensor=True, dry_run=True))
    assert types["output.weight"] == "F16" and types["blk.0.attn_q.weight"] == "Q4_0"


@pytest.mark.parametrize("ftype, attn_v, ffn_down, attn_output", [
    ("Q2_K", ["Q4_K"] * 8, ["Q3_K"] * 8, ["Q3_K"] * 8),                # n_gqa 4: attn_v Q4_K
    ("Q3_K_S", ["Q3_K"] * 8, ["Q3_K"] * 8, ["Q3_K"] * 8),
    ("Q3_K_M", ["Q5_K"] * 2 + ["Q4_K"] * 6, ["Q4_K"] * 8, ["Q4_K"] * 8),
    ("Q3_K_L", ["Q5_K"] * 8, ["Q5_K"] * 8, ["Q5_K"] * 8),
    ("Q4_K_S", ["Q5_K"] * 4 + ["Q4_K"] * 4, ["Q5_K"] + ["Q4_K"] * 7, ["Q4_K"] * 8),
    ("Q5_K_S", ["Q5_K"] * 8, ["Q5_K"] * 8, ["Q5_K"] * 8),
    ("Q5_K_M", ["Q6_K" if use_more_bits(i, 8) else "Q5_K" for i in range(8)],
     ["Q6_K" if use_more_bits(i, 8) else "Q5_K" for i in range(8)], ["Q5_K"] * 8),
    ("Q6_K", ["Q6_K"] * 8, ["Q6_K"] * 8, ["Q6_K"] * 8),
])
def test_k_quant_mixtures(model_f16, ftype, attn_v, ffn_down, attn_output):
    types = types_of(quantize(model_f16, None, ftype, dry_run=True))
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == attn_v
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(8)] == ffn_down
    assert [types[f"blk.{i}.attn_output.weight"] for i in range(8)] == attn_output


def test_numeric_ids_and_aliases(model_f16):
    assert quantize(model_f16, None, "15", dry_run=True).file_type.name == "Q4_K_M"
    assert quantize(model_f16, None, "q4_k", dry_run=True).file_type.name == "Q4_K_M"
    assert quantize(model_f16, None, 7, dry_run=True).file_type.name == "Q8_0"


# ---------------------------------------------------------------------------------------------
# the written file
# ---------------------------------------------------------------------------------------------
def test_output_file_copies_metadata_and_aligns_data(model_f16, tmp_path):
    out = tmp_path / "q8.gguf"
    summary = quantize(model_f16, out, "Q8_0")
    src, dst = GGUFFile(model_f16), GGUFFile(out)
    keys = [k for k in src.metadata if k not in ("general.file_type", "general.quantization_version")]
    assert list(dst.metadata) == keys + ["general.quantization_version", "general.file_type"]
    for k in keys:
        assert dst.metadata_types[k] == src.metadata_types[k]
        assert np.array_equal(dst.metadata[k], src.metadata[k]) if isinstance(src.metadata[k], np.ndarray) \
            else dst.metadata[k] == src.metadata[k]
    assert dst.metadata["general.file_type"] == 7 and dst.metadata["general.quantization_version"] == 2
    assert dst.version == 3 and dst.alignment == 32
    sizes = [t.n_bytes for t in dst.tensors.values()]
    assert out.stat().st_size == dst.data_offset + sum(-(-s // 32) * 32 for s in sizes)
    assert summary.file_bytes == out.stat().st_size
    reader = gguf.GGUFReader(out)                                  # an independent reader agrees
    assert [t.name for t in reader.tensors] == list(dst.tensors)
    for t in dst.tensors.values():                                  # data: Q8_0 of the F16 values
        raw = src.raw(t.name)
        if t.format.name == "Q8_0":
            values = raw.view(np.float16).astype(np.float32)
            reference = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            assert np.array_equal(dst.raw(t.name), reference)
        else:
            assert np.array_equal(dst.raw(t.name), raw)


@pytest.mark.parametrize("ftype, min_corr", [("Q8_0", 0.99), ("F16", 0.99), ("BF16", 0.99), ("F32", 0.99),
                                             ("Q4_K_M", 0.8), ("Q2_K", 0.3)])
def test_quantized_synthetic_model_loads_and_runs(model_f16, tmp_path, ftype, min_corr):
    """Loads in minillm and still computes roughly the same function (random weights through
    8 layers amplify quantization error, hence the low bar for Q2_K)."""
    out = tmp_path / f"{ftype}.gguf"
    quantize(model_f16, out, ftype)
    ref = minillm.load(model_f16).logits([1, 2, 3, 4, 5])
    got = minillm.load(out).logits([1, 2, 3, 4, 5])
    assert got.shape == ref.shape and np.isfinite(got).all()
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > min_corr


def test_requantize_needs_the_flag_and_then_dequantizes_exactly(tmp_path):
    path = synthetic(tmp_path, fmt="Q4_0", n_layer=2)
    with pytest.raises(MinillmError, match="requantizing from type Q4_0, Q8_0 is disabled"):
        quantize(path, tmp_path / "out.gguf", "F32")
    assert not (tmp_path / "out.gguf").exists()
    quantize(path, tmp_path / "out.gguf", "F32", allow_requantize=True)
    src, dst = GGUFFile(path), GGUFFile(tmp_path / "out.gguf")
    for name, t in src.tensors.items():
        expected = gguf.quants.dequantize(src.raw(name), gguf.GGMLQuantizationType(t.ggml_type))
        assert np.array_equal(dst.raw(name).view(np.float32), expected.reshape(dst.raw(name).shape[0], -1))


@pytest.mark.parametrize("call, message", [
    (lambda p, o: quantize(p, o, "Q9_X"), "unknown quantization type"),
    (lambda p, o: quantize(p, o, "99"), "unknown quantization type"),
    (lambda p, o: quantize(p, o, "Q8_0", tensor_types=["attn_v"]), "expected PATTERN=TYPE"),
    (lambda p, o: quantize(p, o, "Q8_0", tensor_types=["attn[=q8_0"]), "bad tensor_types pattern"),
    (lambda p, o: quantize(p, o, "Q8_0", tensor_types=["attn_v=q9_0"]), "unknown tensor type"),
    (lambda p, o: quantize(p, o, "Q8_0", output_tensor_type="IQ2_XS"), "unknown tensor type"),
    (lambda p, o: quantize(p.parent / "missing.gguf", o, "Q8_0"), "no such file"),
    (lambda p, o: quantize(p, p, "Q8_0"), "same file"),
    (lambda p, o: quantize(p, o.parent / "nodir" / "x.gguf", "Q8_0"), "no such directory"),
])
def test_user_errors(model_f16, tmp_path, call, message):
    with pytest.raises(MinillmError, match=message):
        call(model_f16, tmp_path / "out.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_same_file_through_a_link_is_refused(model_f16, tmp_path):
    os.link(model_f16, tmp_path / "hard.gguf")
    with pytest.raises(MinillmError, match="same file"):
        quantize(model_f16, tmp_path / "hard.gguf", "Q8_0")


def test_a_failed_run_leaves_no_file_and_keeps_the_old_out(model_f16, tmp_path, monkeypatch):
    from minillm.quantize import convert

    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous contents")
    real, calls = convert.TensorConverter.__call__, []

    def failing(self, t):
        calls.append(t.name)
        if len(calls) == 5:
            raise MinillmError("disk on fire")
        return real(self, t)
    monkeypatch.setattr(convert.TensorConverter, "__call__", failing)
    with pytest.raises(MinillmError, match="disk on fire"):
        quantize(model_f16, out, "Q8_0")
    assert out.read_bytes() == b"previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "out.gguf"]


def test_named_temp_fallback_and_stale_cleanup(model_f16, tmp_path, monkeypatch):
    """Without O_TMPFILE the file is written as .OUT.minillm-tmp-<pid>; files of dead runs go."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".out.gguf{TMP_TAG}{dead.pid}"
    alive = tmp_path / f".out.gguf{TMP_TAG}{os.getppid()}"
    stale.write_bytes(b"x")
    alive.write_bytes(b"x")
    monkeypatch.delattr(os, "O_TMPFILE")
    quantize(model_f16, tmp_path / "out.gguf", "Q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "model.gguf", "out.gguf"])
    assert GGUFFile(tmp_path / "out.gguf").metadata["general.file_type"] == 7


# ---------------------------------------------------------------------------------------------
# the command line (a subprocess, as users run it)
# ---------------------------------------------------------------------------------------------
_STAND_IN = ("import sys; from minillm.cli.app import app, main; from minillm.cli.quantize import register; "
             "register(app); main()")


def cli(*args) -> list[str]:
    """`python -m minillm quantize ...` once minillm.cli.app registers the command, else the same
    app with register() applied here."""
    from minillm.cli.app import app

    if any(c.name == "quantize" for c in app.registered_commands):
        return [sys.executable, "-m", "minillm", "quantize", *map(str, args)]
    return [sys.executable, "-c", _STAND_IN, "quantize", *map(str, args)]


def run_cli(*args, **kw):
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=300, **kw)


def test_cli_help_lists_types_with_bits_per_weight():
    out = run_cli("--help")
    assert out.returncode == 0
    text = re.sub(r"\s+", " ", out.stdout)
    for line in ("15 Q4_K_M (Q4_K) 4.50 bpw", "7 Q8_0 8.50 bpw", "18 Q6_K 6.56 bpw", "1 F16 16.00 bpw"):
        assert line in text


def test_cli_quantizes_and_reports_sizes(model_f16, tmp_path):
    out = run_cli(model_f16, tmp_path / "q.gguf", "Q4_K_M", "--tensor-type", "attn_k=q8_0", "-t", "1")
    assert out.returncode == 0, out.stderr
    assert "model size =" in out.stderr and "quant size =" in out.stderr and "BPW" in out.stderr
    types = {n: t.format.name for n, t in GGUFFile(tmp_path / "q.gguf").tensors.items()}
    assert types["blk.0.attn_k.weight"] == "Q8_0" and types["blk.0.attn_v.weight"] == "Q6_K"
    dry = run_cli(model_f16, "Q5_0", "--dry-run")                  # llama-quantize's IN TYPE form
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"blk\.0\.attn_q\.weight\s+\[256, 256\]\s+F16 -> Q5_0", dry.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "q.gguf"]


@pytest.mark.parametrize("args, status, message", [
    (["{m}", "{o}", "Q9_X"], 1, "error: unknown quantization type"),
    (["{m}", "{m}", "Q8_0"], 1, "error: input and output are the same file"),
    (["{m}.missing", "{o}", "Q8_0"], 1, "error:"),
    (["{m}", "{o}", "Q8_0", "--tensor-type", "attn_v"], 1, "error: bad --tensor-type"),
    (["{m}"], 2, ""),
    (["{m}", "{o}", "Q8_0", "--threads", "zero"], 2, ""),
])
def test_cli_errors(model_f16, tmp_path, args, status, message):
    out = run_cli(*[a.format(m=model_f16, o=tmp_path / "o.gguf") for a in args])
    assert out.returncode == status and message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_cli_interrupted_leaves_no_output_and_no_temp_file(tmp_path, sig):
    """Kill the CLI in the middle of writing. MINILLM_QUANTIZE_TENSOR_DELAY (a documented test
    hook) makes it sleep after each tensor, so that 'the middle' lasts long enough."""
    model = synthetic(tmp_path, n_layer=8)
    out = tmp_path / "out.gguf"
    env = dict(os.environ, MINILLM_QUANTIZE_TENSOR_DELAY="0.15")
    proc = subprocess.Popen(cli(model, out, "Q8_0"), stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr.readline().startswith("quantizing")
    time.sleep(1.5)                                   # compile cache warm: well into the tensors
    assert proc.poll() is None
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 130)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]
    # and a later run completes normally
    assert run_cli(model, out, "Q8_0").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "out.gguf"]


# ---------------------------------------------------------------------------------------------
# SmolLM2 against llama-quantize
# ---------------------------------------------------------------------------------------------
def compare_with_golden(path, key: str) -> tuple[int, int, list]:
    """(tensors with llama-quantize's type and shape, bit-identical tensors, names that differ)."""
    gold = GOLDEN[key]
    gf = GGUFFile(path)
    assert list(gf.tensors) == list(gold), "tensor order differs from llama-quantize's"
    same_type = identical = 0
    differ = []
    for name, t in gf.tensors.items():
        typ, shape, digest = gold[name]
        same_type += t.format.name == typ and list(t.shape) == shape
        if hashlib.sha256(gf.raw(name).tobytes()).hexdigest() == digest:
            identical += 1
        else:
            differ.append(name)
    return same_type, identical, differ


@pytest.mark.slow
def test_smollm2_requantize_needs_the_flag(tmp_path):
    with pytest.raises(MinillmError, match="allow_requantize"):
        quantize(model_path("smollm2"), tmp_path / "x.gguf", "Q8_0")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_smollm2_requantized_to_f16_is_bit_identical(smollm2_f16):
    same_type, identical, differ = compare_with_golden(smollm2_f16, "smollm2-f16.gguf")
    n = len(GOLDEN["smollm2-f16.gguf"])
    REPORT.append(f"quantize smollm2 Q4_1 -> F16: {identical}/{n} tensors bit-identical to llama-quantize")
    assert same_type == n and identical == n, differ[:5]


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q8_0", "Q5_0", "Q4_K_M"])
def test_smollm2_from_f16_is_bit_identical(smollm2_f16, tmp_path, ftype):
    out = tmp_path / f"smollm2-{ftype}.gguf"
    quantize(smollm2_f16, out, ftype)
    same_type, identical, differ = compare_with_golden(out, f"smollm2-{ftype}.gguf")
    n = len(GOLDEN[f"smollm2-{ftype}.gguf"])
    line = f"quantize smollm2 F16 -> {ftype}: {identical}/{n} tensors bit-identical ({identical / n:.0%})"
    print(line)
    REPORT.append(line)
    assert same_type == n, "tensor types differ from llama-quantize's"
    assert identical == n, differ[:5]
    logits = minillm.load(out).logits([1, 2, 3, 4])
    assert logits.shape == (4, 49152) and np.isfinite(logits).all()


@pytest.mark.slow
def test_smollm2_f16_loads_and_runs(smollm2_f16):
    logits = minillm.load(smollm2_f16).logits([1, 2, 3, 4])
    assert logits.shape == (4, 49152) and np.isfinite(logits).all()


@pytest.mark.slow
def test_smollm2_cli_q4_k_m(smollm2_f16, tmp_path):
    out = run_cli(smollm2_f16, tmp_path / "q.gguf", "15")
    assert out.returncode == 0, out.stderr
    assert "180 of 272 tensors needed a fallback type" in out.stderr
    same_type, identical, _ = compare_with_golden(tmp_path / "q.gguf", "smollm2-Q4_K_M.gguf")
    assert same_type == identical == 272


@pytest.mark.slow
def test_smollm2_q4_k_m_perplexity_matches_llama_cpp_for_its_file(smollm2_f16, tmp_path):
    from minillm.quality.perplexity import perplexity

    reference = json.loads((DATA / "ppl_reference.json").read_text())["smollm2-Q4_K_M.gguf"]
    out = tmp_path / "q4km.gguf"
    quantize(smollm2_f16, out, "Q4_K_M")
    ppl = perplexity(minillm.load(out), (DATA / "ppl_text_dev.txt").read_text(), n_ctx=512).ppl
    REPORT.append(f"quantize smollm2 Q4_K_M: perplexity {ppl:.4f} (llama.cpp {reference} for its own file)")
    assert abs(ppl - reference) / reference < 0.01


def test_library_api_is_minillm_quantize(model_f16, tmp_path):
    summary = minillm.quantize(model_f16, tmp_path / "q8.gguf", "Q8_0")
    assert (tmp_path / "q8.gguf").exists() and summary is not None
    assert minillm.quantize.quantize is quantize

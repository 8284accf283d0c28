"""The kinds of host the twin simulates, by name: `preset("gpu-8b")`, or `PRESETS`.

Each figure says where it comes from in its comment, and each profile's `source` field names
its sources in one line. Measured: the tiny model on this machine (bench/twin/measure_tiny.py).
Published: llama.cpp's own benchmarks (llama-bench `pp`/`tg`, tokens per second) on the card
named, or a close one. Estimated: everything scaled from a published figure, with the arithmetic.

The rules the estimates follow:
- decode of one stream reads every weight once per token, so it scales with the memory
  bandwidth over the model's bytes; prefill is compute-bound, so it scales with the card's
  int8 tensor throughput (llama.cpp's MMQ kernels) over the parameters;
- decode with n streams at once (one batch per step, as llama-server runs its slots) follows
  the measured gains of one CUDA card, `CUDA_BATCH_GAINS`: llama.cpp PR #15802 (RTX 3090,
  llama 8B Q4_0, `pp512` at microbatch 1..4: 156.56, 279.89, 390.96, 470.48 t/s, a step of n
  tokens at a time, as n streams decoding together);
- a model's bytes are llama-bench's size (GiB) x 1.0737 (GB, 1e9 bytes, as `size_gb` counts);
- its load reads the file at 3.9 GiB/s (llama.cpp issue #19191: a 59 GiB GGUF read from disk
  in 15.13 s) and then starts its CUDA context, about 1.5 s a card (an estimate);
- `--cache-ram` restore copies the KV state from host memory back to the card at an estimated
  10 GB/s (a pageable host-to-device copy over PCIe 4.0 x16), so tokens/s = 10e9 / KV bytes;
- KV bytes per token, f16 cache: layers x KV heads x head dim x 2 (K and V) x 2 bytes.
"""

from __future__ import annotations

from .shapes import HostProfile, ModelProfile

__all__ = ["GPU_8B", "GPU_70B", "GPU_MIXED", "PRESETS", "TINY", "UnknownPreset", "preset"]

PR_15802 = "https://github.com/ggml-org/llama.cpp/pull/15802 (RTX 3090 llama 8B Q4_0 ub 1..4)"
PR_19053 = "https://github.com/ggml-org/llama.cpp/pull/19053 (RTX 6000 Ada perf table)"
XIONGJIEDAI = "https://github.com/XiongjieDai/GPU-Benchmarks-on-LLM-Inference (README tables)"
ISSUE_19191 = "https://github.com/ggml-org/llama.cpp/issues/19191 (59 GiB read in 15.13 s)"

# Aggregate decode of n streams over one stream's, n = 1..4 (PR #15802, above).
CUDA_BATCH_GAINS = (1.0, 279.89 / 156.56, 390.96 / 156.56, 470.48 / 156.56)
CACHE_RAM_DEFAULT_MIB = 8192  # llama-server --help: "--cache-ram N ... (default: 8192)"
RESTORE_BYTES_PER_S = 10e9


def batched(one_stream: float, gains: tuple[float, ...] = CUDA_BATCH_GAINS) -> tuple[float, ...]:
    """Tokens per second each stream gets with 1..len(gains) streams decoding together."""
    return tuple(round(one_stream * gain / n, 1) for n, gain in enumerate(gains, start=1))


def kv_bytes(layers: int, kv_heads: int, head_dim: int) -> int:
    return layers * kv_heads * head_dim * 2 * 2


# --- tiny: the random 2-layer model of tests/e2e/llama on this machine's llama-server --------
# Measured 6 Dec 2026 on this 2-core machine (build 11434, one thread, 4 slots of 4,096 tokens,
# --cache-ram 7, -sps 0.95), medians over 5-7 requests:
#   nice -n 10 .venv/bin/python bench/twin/measure_tiny.py --repeats 5 --slots 4 \
#       --prompt 3000 --context 2048 --predict 256
# prefill 25,597 t/s (3,000-token prompts; 25,804 in a run with 2 slots: 25,700 kept; a
# 2-request trial of 1,000-token prompts ran at 62,555: attention weighs much in so small a
# model); decode per stream after 2,048 tokens of prompt: 645, 347, 233, 180 at 1..4 streams
# (aggregate 645, 694, 700, 719: one CPU thread gains little from batching; with 2 slots, 628
# and 328; a trial of 32-token prompts decoding 1,024 tokens gave 1,881, 1,019, 534, 453, an
# aggregate that falls past 2 streams); the server healthy 0.16-0.21 s after its start; restore
# 7.06M t/s (6.82M with 2 slots), as (saved + loaded) tokens over llama-server's own "prompt
# cache update took X ms"; 268 bytes a token in --cache-ram (2 layers x 2 KV heads x 16 x 2 x 2
# = 256 of K and V, and 12 of the saved state's own per token).
TINY_MODEL = ModelProfile(
    name="crossbar-tiny",
    size_gb=0.0092,
    load_s=0.2,
    prefill_tps=25_700.0,
    decode_tps=(645.0, 347.0, 233.0, 180.0),
    restore_tps=6_900_000.0,
    kv_bytes_per_token=268,
    source="measured on this machine with bench/twin/measure_tiny.py (llama-server build "
    "11434, one thread), 6 Dec 2026",
)
TINY = HostProfile(
    name="tiny",
    slots=2,  # bench-cache's --parallel (bench/README.md, "The fleet")
    cache_ram_mib=7,  # bench-cache's: holds of the tiny model what 8 GiB holds of a 70B
    memory_gb=1.0,  # not a limit: the model is 9 MB
    models_max=1,
    models={TINY_MODEL.name: TINY_MODEL},
    source="bench-cache's host (bench/README.md), measured by bench/twin/measure_tiny.py",
)

# --- gpu-8b: Llama 3.1 8B Q4_K_M on one 48 GB RTX 6000 Ada (the L40S's AD102 chip) ----------
# PR #19053 on the RTX 6000 Ada (960 GB/s): llama 8B Q4_0 (4.33 GiB) tg128 168.87, pp8096
# 8008.29; llama 3B Q4_K_M (1.87 GiB, 3.21 B) tg128 315.50, pp8096 16148.93.
# decode, by bytes: 168.87 x 4.33 / 4.58 (the Q4_K_M's GiB) = 159.7;
# prefill, by parameters from the Q4_K_M 3B: 16148.93 x 3.21 / 8.03 = 6,455 (Q4_0's 8,008 is
# the faster quantization's); load: 4.58 / 3.9 + 1.5 = 2.7 s; KV: 32 x 8 x 128 x 4 = 128 KiB.
LLAMA_8B = ModelProfile(
    name="llama-3.1-8b-instruct-q4_k_m",
    size_gb=4.92,  # 4.58 GiB (XiongjieDai's "Total VRAM Requirements" table)
    load_s=2.7,
    prefill_tps=6_455.0,
    decode_tps=batched(159.7),
    restore_tps=RESTORE_BYTES_PER_S / kv_bytes(32, 8, 128),
    kv_bytes_per_token=kv_bytes(32, 8, 128),
    source=f"{PR_19053}, scaled by bytes (decode) and parameters (prefill); batching: "
    f"{PR_15802}; load: {ISSUE_19191}; restore: estimated 10 GB/s",
)
GPU_8B = HostProfile(
    name="gpu-8b",
    slots=4,
    cache_ram_mib=CACHE_RAM_DEFAULT_MIB,  # 64k tokens of this model's KV
    memory_gb=48.0,
    models_max=1,
    models={LLAMA_8B.name: LLAMA_8B},
    source=f"one 48 GB RTX 6000 Ada / L40S: {PR_19053}",
)

# --- gpu-70b: Llama 3.1 70B Q4_K_M split by layers over two 80 GB A100 SXM (2,039 GB/s) -----
# Scaled from the 8B above (same llama.cpp era):
# decode: 159.7 x (4.58 / 39.59 GiB) x (2039 / 960 GB/s) = 39.2 on an Ada-efficient card, x 0.72
# = 28.2, since the A100 turned fewer of its bytes/s into tokens than the RTX 6000 Ada in the
# same build (XiongjieDai's Dec 2023 tables: A100 80GB 70B q4_0 25.68 t/s x 36.37 GB = 934 GB/s
# of 2,039, 0.46; RTX 6000 Ada 65B q4_0 17.39 x 35.5 GB = 617 of 960, 0.64; 0.46 / 0.64 = 0.72,
# or 0.75 had RunPod's A100 been the 1,935 GB/s PCIe one); a layer split
# adds little to a token's time (that table: 70B Q4_K_M on 2, 4 and 8 RTX 4090s, 19.22, 19.80,
# 18.94 t/s).
# prefill: 6,455 x 8.03 / 70.55 (parameters) x 624 / 728.5 (A100 over RTX 6000 Ada, dense int8
# TOPS) = 629; the Dec 2023 table's A100 70B q4_0 pp512, 612, agrees.
# load: 39.59 / 3.9 + 2 cards' start = 12 s; KV: 80 x 8 x 128 x 4 = 320 KiB (8 GiB of
# --cache-ram: 26k tokens).
LLAMA_70B = ModelProfile(
    name="llama-3.1-70b-instruct-q4_k_m",
    size_gb=42.51,  # 39.59 GiB (XiongjieDai's table; llama-bench prints the same)
    load_s=12.0,
    prefill_tps=629.0,
    decode_tps=batched(28.2),
    restore_tps=RESTORE_BYTES_PER_S / kv_bytes(80, 8, 128),
    kv_bytes_per_token=kv_bytes(80, 8, 128),
    source=f"estimated from the 8B ({PR_19053}) by bytes x bandwidth and parameters x int8 "
    f"TOPS, A100 efficiency from {XIONGJIEDAI}; batching: {PR_15802}; load: {ISSUE_19191}",
)
GPU_70B = HostProfile(
    name="gpu-70b",
    slots=4,
    cache_ram_mib=CACHE_RAM_DEFAULT_MIB,
    memory_gb=160.0,
    models_max=1,
    models={LLAMA_70B.name: LLAMA_70B},
    source=f"two 80 GB A100 SXM, layer split: estimated, {XIONGJIEDAI}, {PR_19053}",
)

# --- gpu-mixed: router mode on one 48 GB RTX 6000 Ada, four models, two loaded at a time ----
# Qwen2.5-Coder 7B Q4_K_M (llama-bench: "qwen2 7B Q4_K - Medium | 4.36 GiB | 7.62 B"), from the
# 8B: decode 159.7 x 4.58 / 4.36 = 167.8, prefill 6,455 x 8.03 / 7.62 = 6,802; load 4.36 / 3.9
# + 1.5 = 2.6 s; KV: 28 layers x 4 KV heads x 128 x 4 = 56 KiB.
QWEN_CODER_7B = ModelProfile(
    name="qwen2.5-coder-7b-instruct-q4_k_m",
    size_gb=4.68,
    load_s=2.6,
    prefill_tps=6_802.0,
    decode_tps=batched(167.8),
    restore_tps=RESTORE_BYTES_PER_S / kv_bytes(28, 4, 128),
    kv_bytes_per_token=kv_bytes(28, 4, 128),
    source=f"estimated from the 8B ({PR_19053}) by bytes and parameters; batching: {PR_15802}",
)
# Llama 3.2 3B Q4_K_M, published on this very card (PR #19053): tg128 315.50, pp8096 16148.93;
# load 1.87 / 3.9 + 1.5 = 2.0 s; KV: 28 layers x 8 KV heads x 128 x 4 = 112 KiB.
LLAMA_3B = ModelProfile(
    name="llama-3.2-3b-instruct-q4_k_m",
    size_gb=2.01,  # 1.87 GiB (llama-bench in geerlingguy/ai-benchmarks#43)
    load_s=2.0,
    prefill_tps=16_148.9,
    decode_tps=batched(315.5),
    restore_tps=RESTORE_BYTES_PER_S / kv_bytes(28, 8, 128),
    kv_bytes_per_token=kv_bytes(28, 8, 128),
    source=f"{PR_19053}; batching: {PR_15802}; load: {ISSUE_19191}",
)
# Qwen2.5 0.5B Q8_0 (an embedder's size: 531,068,928 bytes, 494 M parameters, llama-bench's
# model_size): no CUDA figure found for it. Taken from TinyLlama 1.1B Q4_K_M (636 MiB, about
# as many bytes) on an RTX 4090, the RTX 6000 Ada's chip (geerlingguy/ai-benchmarks#43, Vulkan:
# tg128 762.37, pp4096 18709.17), not scaled: a model this small is bound by per-step overhead,
# not bandwidth. load 0.49 / 3.9 + 1.5 = 1.6 s; KV: 24 layers x 2 KV heads x 64 x 4 = 12 KiB.
QWEN_05B = ModelProfile(
    name="qwen2.5-0.5b-instruct-q8_0",
    size_gb=0.53,
    load_s=1.6,
    prefill_tps=18_709.0,
    decode_tps=batched(762.4),
    restore_tps=RESTORE_BYTES_PER_S / kv_bytes(24, 2, 64),
    kv_bytes_per_token=kv_bytes(24, 2, 64),
    source="estimated: TinyLlama 1.1B's rates on an RTX 4090, "
    f"https://github.com/geerlingguy/ai-benchmarks/issues/43; batching: {PR_15802}",
)
GPU_MIXED = HostProfile(
    name="gpu-mixed",
    slots=4,  # per model: llama-server's router starts each model with the same --parallel
    cache_ram_mib=CACHE_RAM_DEFAULT_MIB,
    memory_gb=48.0,
    models_max=2,  # llama-server --models-max (its default is 4)
    models={model.name: model for model in (LLAMA_8B, QWEN_CODER_7B, LLAMA_3B, QWEN_05B)},
    source=f"one 48 GB RTX 6000 Ada in router mode: {PR_19053}, estimates as each model says",
)

PRESETS: dict[str, HostProfile] = {host.name: host for host in (TINY, GPU_8B, GPU_70B, GPU_MIXED)}


class UnknownPreset(KeyError):
    """No preset has that name; the message lists the names there are."""

    def __str__(self) -> str:  # KeyError's own would quote the message like a key
        return str(self.args[0])


def preset(name: str) -> HostProfile:
    """The preset called `name`; raises UnknownPreset (a KeyError) naming every preset."""
    try:
        return PRESETS[name]
    except KeyError:
        names = ", ".join(sorted(PRESETS))
        raise UnknownPreset(f"no host preset {name!r}; the presets: {names}") from None

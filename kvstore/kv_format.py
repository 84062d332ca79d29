"""KV block formats: how a paged block stores its K and V, and the bytes it takes.

``kv_cache_dtype`` names the format:

- ``auto``: elements of the model's dtype, no scales (a block as it always was);
- ``int8``: symmetric int8, one scale per token and kv head: x ~= q * scale with
  scale = absmax / 127 over the head's head_dim values, q in [-127, 127];
- ``fp8``: float8 e4m3 (torch.float8_e4m3fn) scaled the same way to its largest finite
  magnitude, 448 (needs a GPU of compute capability 8.9 or newer, or the CPU's emulation).

A quantized block is its elements plus its scales: both are indexed by the block id and written
once, with the block's tokens, so anything that moves or shares blocks (the prefix cache,
offload tiers, speculation's rollback, tensor parallelism) moves the scales with them and needs
no other change.

Why a float16 scale, not float32: at head_dim 64 (SmolLM2, Llama-3.2-1B) a float32 scale
costs 4 bytes against 64 of int8 elements, and the block holds only 128 / 68 = 1.88x the
bfloat16 blocks; with 2 bytes it holds 128 / 66 = 1.94x (1.97x at head_dim 128). Quantizing
with the scale as stored (rounded to float16 first) keeps the error bound exact, and clamping
the scale into float16's normal range keeps it finite and non-zero (see workers/kv_quant.py).

Keys rotated (``rotate_keys``, int8 only): each token's key row of every kv head is stored as
k @ H, H the normalized Sylvester Hadamard matrix of order head_dim (symmetric, H @ H = I),
taken after rotary and before quantizing; every query is rotated alike before attention, so
q @ H . k @ H = q . k and the attention kernels read the blocks as before. Values are not
rotated. Why: a key row's few outlier channels set its absmax, hence the int8 step of all its
other channels; H spreads each outlier over all head_dim channels, so the absmax falls toward
the row's RMS and the step with it (top-1 agreement 98.73% -> 99.36% on SmolLM2-135M,
93.3% -> 95.3% on Qwen2.5-Coder-0.5B: docs/benchmarks.md). Not for fp8: e4m3 gives each
element its own exponent, so an outlier costs the other channels nothing, and spreading it
makes every channel large and as coarse as it (Qwen2.5-Coder-0.5B: 93.9% unrotated, 80.4%
rotated). The rotation belongs to the block format, recorded here and in the blocks' hash
keys (``hash_key``), so nothing that shares or moves blocks — the prefix cache, the offload
tiers, speculation, tensor parallelism (a rank rotates its own heads), CUDA graphs — changes:
a block is bytes whose meaning the format names. A head_dim that is no power of two has no
Sylvester matrix: such a model's keys are stored unrotated (``rotates_keys``).

Keys centered (``center_keys``; int8 with the rotation, fp8 without one): before it, each
layer's keys lose a fixed vector m per kv head, their mean over a calibration pass at start-up
(workers/attention/key_centers.py). Softmax is blind to it: q . (k - m) = q . k - q . m, and
q . m is the same for every key a query sees, so the attention is unchanged while the int8 step
no longer spends itself on what all keys share. Why: Qwen2.5's k_proj bias, turned by rotary,
is most of every key row (Qwen2.5-Coder-0.5B, layer 0: absmax 129-146, RMS ~35, nearly all of
it the bias); centered, top-1 agreement goes 95.3% -> 99.1% there (docs/benchmarks.md).
e4m3 gives each element its own exponent, but a shared component still sets the elements'
magnitudes and so their steps (3 mantissa bits: 1/16 of the element): centered, fp8 on
Qwen2.5-Coder-0.5B goes 93.9% -> 96.4% top-1, mean KL 1.6e-2 -> 2.2e-3; SmolLM2-135M (no k
bias) 96.5% -> 96.6%. m is a
number of the process, not of the format: the engine hashes its digest into the blocks' keys,
so a block centered by another m (another dtype or device) is never mixed in.

Pure description: names and byte counts, no tensors. workers/ maps ``element_dtype`` and
``scale_dtype`` (torch's names) to torch dtypes.
"""

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
FP8_MIN_CUDA_CAPABILITY = (8, 9)  # Ada and Hopper convert float32 <-> e4m3 in hardware
# the model dtypes an "auto" cache may take, and their bytes an element
MODEL_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SCALE_DTYPE, SCALE_BYTES = "float16", 2


@dataclass(frozen=True)
class KVFormat:
    name: str  # as kv_cache_dtype names it: auto | int8 | fp8
    element_dtype: str  # torch's name of K's and V's elements
    element_bytes: int
    max_abs: float | None = None  # the largest quantized magnitude; None: not quantized
    rotate_keys: bool = False  # keys stored times the Hadamard matrix, where head_dim allows
    center_keys: bool = False  # stored less their calibrated mean (before any rotation)

    @property
    def quantized(self) -> bool:
        return self.max_abs is not None

    @property
    def scale_bytes(self) -> int:
        return SCALE_BYTES if self.quantized else 0

    def rotates_keys(self, head_dim: int) -> bool:
        """Whether a model of ``head_dim`` stores its keys rotated: only a power of two has a
        Sylvester Hadamard matrix (every catalog model's head_dim is 64 or 128)."""
        return self.rotate_keys and head_dim > 0 and head_dim & (head_dim - 1) == 0

    def centers_keys(self, head_dim: int) -> bool:
        """Whether keys are stored less their calibrated mean (the attention-input kernel
        subtracts it, before any rotation): int8 where its keys are rotated, as it was
        calibrated and measured; fp8 always."""
        return self.center_keys and (self.rotates_keys(head_dim) or not self.rotate_keys)

    @property
    def hash_key(self) -> str | None:
        """The blocks' extra hash key: None for ``auto``, else the format with its rotation,
        so no cache, tier or peer ever hands a block of one format to another (the model,
        hashed beside it, fixes head_dim and so whether keys are rotated)."""
        if not self.quantized:
            return None
        return (f"kv_cache_dtype={self.name}" + ("+hadamard-keys" if self.rotate_keys else "")
                + ("+centered-keys" if self.center_keys else ""))

    def bytes_per_token_head(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) in one kv head: its elements and its scale."""
        return head_dim * self.element_bytes + self.scale_bytes

    def bytes_per_block(self, num_layers: int, num_kv_heads: int, head_dim: int,
                        block_size: int) -> int:
        """K and V of block_size tokens in every layer, scales included."""
        per_token = 2 * num_layers * num_kv_heads * self.bytes_per_token_head(head_dim)
        return per_token * block_size


INT8 = KVFormat("int8", "int8", 1, 127.0, rotate_keys=True, center_keys=True)
FP8 = KVFormat("fp8", "float8_e4m3fn", 1, 448.0, center_keys=True)  # unrotated: see above
QUANTIZED_FORMATS = (INT8, FP8)


# what a format costs in accuracy where a one-byte format with a better figure exists: said at
# start-up (top-1 agreement with an unquantized cache, `tandem bench kv-accuracy`, CPU float32;
# docs/benchmarks.md)
ACCURACY_NOTES = {
    "fp8": "kv_cache_dtype 'fp8' (e4m3, 3 mantissa bits) agrees less with an unquantized cache "
           "than 'int8' does: top-1 agreement 96.6% against int8's 99.5% on SmolLM2-135M, "
           "96.4% against 99.1% on Qwen2.5-Coder-0.5B (docs/benchmarks.md); choose 'int8' "
           "for the same memory and better accuracy",
}


def check_kv_cache_dtype(name: str) -> None:
    """ValueError naming the choices when ``name`` is no format."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r} (choose from "
                         f"{', '.join(KV_CACHE_DTYPES)})")


def kv_format(name: str, model_dtype: str) -> KVFormat:
    """The format ``name`` stands for, for a model whose activations are ``model_dtype``."""
    check_kv_cache_dtype(name)
    if name == "int8":
        return INT8
    if name == "fp8":
        return FP8
    if model_dtype not in MODEL_DTYPE_BYTES:
        raise ValueError(f"no KV format of model dtype {model_dtype!r} (choose from "
                         f"{', '.join(MODEL_DTYPE_BYTES)})")
    return KVFormat("auto", model_dtype, MODEL_DTYPE_BYTES[model_dtype])


def check_device_supports(fmt: KVFormat, *, has_float8: bool,
                          cuda_capability: tuple[int, int] | None) -> None:
    """ValueError when the device cannot hold ``fmt``: fp8 needs torch's float8_e4m3fn and,
    on CUDA (``cuda_capability`` not None), compute capability 8.9 or newer."""
    if fmt.name != "fp8":
        return
    if not has_float8:
        raise ValueError("kv_cache_dtype 'fp8' needs torch.float8_e4m3fn, which this torch "
                         "lacks: use 'int8' or a newer torch")
    if cuda_capability is not None and cuda_capability < FP8_MIN_CUDA_CAPABILITY:
        major, minor = cuda_capability
        raise ValueError(f"kv_cache_dtype 'fp8' (e4m3) needs a GPU of compute capability 8.9 "
                         f"or newer; this one is {major}.{minor}: use 'int8'")


def hash_key_of(name: str) -> str | None:
    """The extra hash key of the blocks that kv_cache_dtype ``name`` writes (KVFormat.hash_key),
    whatever the model's dtype: None for ``auto``."""
    check_kv_cache_dtype(name)
    return next((fmt.hash_key for fmt in QUANTIZED_FORMATS if fmt.name == name), None)

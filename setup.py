"""Installs `megatron` (Megatron-Core-style training stack) and the standalone `megatron_fsdp` package."""

from setuptools import find_packages, setup

FSDP_SOURCE_DIR = "megatron/core/distributed/fsdp/src/megatron_fsdp"


def megatron_fsdp_packages():
    """The standalone package and its subpackages, installed under the top-level name `megatron_fsdp`."""
    subpackages = find_packages(where=FSDP_SOURCE_DIR)
    return ["megatron_fsdp"] + [f"megatron_fsdp.{name}" for name in subpackages]


def megatron_fsdp_package_dirs():
    dirs = {"megatron_fsdp": FSDP_SOURCE_DIR}
    for name in find_packages(where=FSDP_SOURCE_DIR):
        dirs[f"megatron_fsdp.{name}"] = f"{FSDP_SOURCE_DIR}/{name.replace('.', '/')}"
    return dirs


# The modelopt release the post-training example is tested with; it installs without pulling another torch,
# and imports requests and huggingface_hub without declaring them.
TRITON_REQUIREMENT = "triton>=3.2; sys_platform == 'linux' and platform_machine == 'x86_64'"
MODELOPT_REQUIREMENTS = ["nvidia-modelopt==0.47.0", "requests", "huggingface_hub"]

# A range the local CPU wheel (2.13.0) satisfies, so installing never pulls a CUDA build where it is present.
TORCH_REQUIREMENT = "torch>=2.6,<2.15"

setup(
    name="megatron-core-fsdp",
    version="0.1.0",
    description="Megatron-Core-style GPT training with Megatron-FSDP (ZeRO-0..3), tensor and pipeline parallelism",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron", "megatron.*"]) + megatron_fsdp_packages(),
    package_dir=megatron_fsdp_package_dirs(),
    install_requires=[TORCH_REQUIREMENT, "numpy", "pyyaml"],
    extras_require={
        # transformers: the checkpoint tools' test loads a --to hf export with it and compares logits.
        # tiktoken: --tokenizer-type TikTokenizer; sentencepiece: the SentencePiece tokenizer types.
        # triton: the FP8 quantization kernels (GPUs); their tests run them on the CPU under Triton's interpreter.
        "dev": ["pytest>=7", "tokenizers>=0.15", "tensorboard", "transformers>=5", "tiktoken>=0.7",
                "sentencepiece", TRITON_REQUIREMENT, *MODELOPT_REQUIREMENTS],
        "test": ["pytest>=7", "tokenizers>=0.15", "tensorboard", "tiktoken>=0.7", "sentencepiece", TRITON_REQUIREMENT,
                 *MODELOPT_REQUIREMENTS],
        "modelopt": MODELOPT_REQUIREMENTS,
        "te": ["transformer-engine[pytorch]"],
    },
    py_modules=["pretrain_gpt", "pretrain_mamba"],
)

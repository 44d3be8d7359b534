"""Packaging for megatron_kto: KTO/DPO alignment on megatron-core with TP/PP/DP."""

from setuptools import find_packages, setup

setup(
    name="megatron_kto",
    version="0.1.0",
    description="KTO and DPO alignment of GPT/Llama models on megatron-core (TP, PP, DP).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_kto", "megatron_kto.*"]),
    include_package_data=True,
    install_requires=[
        # torch is installed first and pinned by the user/CI (a CPU or CUDA build); any >=2.4 works.
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.17",
        "omegaconf>=2.3",
        "hydra-core>=1.3",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
        "jinja2>=3.1",
        "safetensors>=0.4",
        "tqdm>=4.60",
        "numpy>=1.24",
        # megatron-core's dist_checkpointing imports psutil but does not declare it.
        "psutil>=5.9",
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        # Gated DeltaNet kernels (Qwen3-Next, Qwen3.5) on accelerators: Triton, variable-length.
        "fla": ["flash-linear-attention>=0.5.2"],
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],
        "parquet": ["pyarrow"],
        "dev": [
            "pytest>=8",
            # the README's test command runs test files in two worker processes
            "pytest-xdist>=3.5",
            "ruff>=0.6",
            "transformers>=4.45",
            "trl==1.16.0",
            "peft>=0.17",
            "pyarrow",
            "tensorboard",
        ],
    },
)

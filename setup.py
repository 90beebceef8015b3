from pathlib import Path

from setuptools import find_packages, setup

version = {}
exec(Path("megatron_hetero/_version.py").read_text(), version)

setup(
    name="megatron-hetero",
    version=version["__version__"],
    description="Plan and run Megatron-LM training on a mixed pool of GPUs",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # patches/ (one pretrain_gpt.py patch per Megatron-LM release line) ships inside the package
    # as megatron_hetero._patches, so that `patch-megatron` works from an installed wheel too
    packages=find_packages(include=["megatron_hetero", "megatron_hetero.*"]) + ["megatron_hetero._patches"],
    package_dir={"megatron_hetero._patches": "patches"},
    package_data={"megatron_hetero": ["hardware/*.yaml"], "megatron_hetero._patches": ["*/*.patch"]},
    install_requires=[
        "megatron-core>=0.16",
        "torch>=2.4",
        "pyyaml>=6",
        "numpy>=1.24",
        "scipy>=1.11",
        "rich>=13",
        "einops>=0.8",  # megatron-core's HyperCommGrid enumerates its groups with it (mesh plans)
        "psutil>=5.9",  # megatron-core 0.17 writes torch_dist checkpoints only with it
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "matplotlib>=3.7"],
        "plot": ["matplotlib>=3.7"],
        "te": ["transformer-engine[pytorch]"],
        "apex": ["apex"],
    },
    entry_points={"console_scripts": ["megatron-hetero=megatron_hetero.cli:main"]},
)

"""deadpool_ext: in-memory snapshots, peer replicas, hot-swap and tiered checkpoints for DeepSpeed and
Megatron-Core. Install: ``pip install -e .`` (see README.md for the CPU/GPU torch pin)."""
from setuptools import find_packages, setup

setup(
    name="deadpool_ext",
    version="0.1.0",
    description="Keeps DeepSpeed and Megatron-Core training jobs alive through failures",
    # The repository's top-level patches/ installs as deadpool_ext.patches: nothing named "patches" lands on a
    # user's path.
    packages=find_packages(include=["deadpool_ext", "deadpool_ext.*"]) + ["deadpool_ext.patches"],
    package_dir={"deadpool_ext.patches": "patches"},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "deepspeed>=0.16",
        "numpy",
        "xxhash>=3.0",
        "psutil",
        "transformers>=4.40",
    ],
    # A training job needs only install_requires. The simulator's plots, the chaos/test harness and the gates
    # are extras (``pip install -e .[tools,test]``); nothing in the product imports them.
    extras_require={
        "megatron": ["megatron-core>=0.16,<0.17"],
        "s3": ["s3fs", "fsspec"],
        "tools": ["matplotlib", "safetensors"],
        "test": ["pytest>=8", "pytest-timeout", "s3fs", "moto[server]>=5", "ruff", "mypy", "import-linter",
                 "pyyaml"],  # pyyaml: the Kubernetes example read by tests/multihost/test_kubernetes.py
    },
    entry_points={"console_scripts": ["deadpool-run=deadpool_ext.launcher.cli:main", "deadpool=deadpool_ext.cli:main"]},
)

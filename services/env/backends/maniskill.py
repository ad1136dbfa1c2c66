"""ManiSkill3 (``mani-skill`` 3.0.1 on SAPIEN 3.0.3 / PhysX) as a backend. Runs in its own environment
(rlfleet.simulators.MANISKILL_ENV: mani-skill, sapien and a CPU torch, plus a Vulkan driver on the host).

- env_id: a registered ManiSkill task id (``PickCube-v1``, ``PushCube-v1``, ``StackCube-v1``,
  ``PegInsertionSide-v1``, ...). Tasks whose assets are not downloaded are refused at once, naming the download
  command (ManiSkill would otherwise ask on stdin). RLinf's ``PutOnPlateInScene25Main-v3`` is rlfleet's own
  implementation (services.env.backends.maniskill_put_on_plate, registered with ManiSkill's registry here) on
  RLinf's assets (services.env.backends.put_on_plate_assets); its v1/v2 variants are refused with what to do.
- params (``env.*.init_params``):
  ``obs_mode``: ``state`` (default) -> ``{"state": float32 [D]}``; ``rgb`` -> ``{"pixels": uint8 [H, W, 3]`` from
  the task's sensor camera (``camera``, default its first), ``"state": float32 [D]}`` = the agent's proprioception
  and the task's extra state (``agent`` and ``extra`` entries, flattened in ManiSkill's order).
  ``image_size``: ``S`` or ``[H, W]`` (default 64) for the sensor cameras. The Bridge digital twins (Put*InScene*,
  PutOnPlateInScene25Main-v3) render ManiSkill's ``rgb+segmentation`` with their background image at the
  camera's own 640x480, resized to ``image_size`` (area interpolation). ``control_mode``: ManiSkill's
  controller (default: the task's own, ``pd_joint_delta_pos`` for the Panda tasks). ``reward_mode``:
  ``normalized_dense`` (default where the task has it, else the task's own), ``dense``, ``sparse`` or ``none``.
  ``sim_backend``: ``auto`` (default: ``gpu`` when torch sees CUDA, else ``cpu``), ``cpu`` (PhysX CPU: one
  ManiSkill env per slot, as ManiSkill's CPU simulation holds one scene per env) or ``gpu`` (PhysX GPU: ONE
  ManiSkill env batching all ``num_envs`` slots).
  ``env_kwargs``: more keyword arguments for the task's constructor (e.g. ``robot_uids``, ``sim_config``).
- Resets: a seeded reset is ManiSkill's ``reset(seed=s)`` (same seed, same start, on any slot); an unseeded reset
  draws its seed from the slot's generator, itself seeded by the slot's last seed, so runs repeat. No fixed
  initial states (``num_reset_states`` 0), except PutOnPlateInScene25Main-v3, whose episode ids are its fixed
  initial states (RLinf's ``use_fixed_reset_state_ids``). Each reset returns the slot's instruction (the task's
  ``get_language_instruction()`` where it has one: per episode).
- Steps: reward, success (``info["success"]``) and terminated (ManiSkill's own: success or failure) come from
  the task; ManiSkill's time limit is not applied (``max_episode_steps`` of the run config is, by VecEnv; the
  task's own limit is reported as the backend's ``max_episode_steps``).
- Batched GPU simulation (``sim_backend: gpu``) steps every slot at once: a step of some slots steps the others
  with a zero action and then puts their simulation state back (``get_state``/``set_state``), and a reset of some
  slots resets them one by one (a ManiSkill reset seeds one RNG for the whole batch), so per-slot seeds still fix
  each start. Prefer stepping all slots together there (``rollout.pipeline_stage_num: 1``).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from rlfleet.errors import InvalidRequest
from rlfleet.wire.spaces import TensorSpace
from rlfleet.registry import did_you_mean
from services.env.backends import put_on_plate_assets
from services.env.backends.base import BackendUnavailable, SimBackend, StepResult

# RLinf's ManiSkill task ids that rlfleet does not implement (RLinf's earlier versions of its own task)
RLINF_ONLY = ("PutOnPlateInScene25Main-v2", "PutOnPlateInScene25Main-v1")
INSTRUCTIONS = {  # ManiSkill ships no language; short imperative descriptions of the tabletop tasks
    "PickCube-v1": "pick up the red cube and move it to the goal",
    "PushCube-v1": "push the cube to the red and white target",
    "PullCube-v1": "pull the cube back to the target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "PegInsertionSide-v1": "insert the peg into the hole in the box from the side",
    "LiftPegUpright-v1": "lift the peg and stand it upright",
    "PokeCube-v1": "use the peg to poke the cube to the goal",
    "PlaceSphere-v1": "place the sphere into the bin",
    "RollBall-v1": "push the ball so that it rolls to the goal",
    "PushT-v1": "push the T-shaped block into the target pose",
    "PullCubeTool-v1": "use the tool to pull the cube closer",
    "StackPyramid-v1": "stack the cubes into a pyramid",
    "PlugCharger-v1": "plug the charger into the receptacle",
    "PickSingleYCB-v1": "pick up the object and move it to the goal",
    "PickClutterYCB-v1": "pick up the target object from the clutter and move it to the goal",
    "TurnFaucet-v1": "turn the faucet handle",
    "OpenCabinetDrawer-v1": "open the cabinet drawer",
    "OpenCabinetDoor-v1": "open the cabinet door",
    "PutCarrotOnPlateInScene-v1": "put carrot on plate",
    "PutSpoonOnTableClothInScene-v1": "put the spoon on the towel",
    "StackGreenCubeOnYellowCubeBakedTexInScene-v1": "stack the green block on the yellow block",
    "PutEggplantInBasketScene-v1": "put eggplant into yellow basket",
}
PARAMS = ("obs_mode", "image_size", "camera", "control_mode", "reward_mode", "sim_backend", "env_kwargs")
VULKAN_FIX = ("SAPIEN (ManiSkill's simulator) needs a Vulkan driver even for state observations. On a CPU host "
              "that is Mesa's lavapipe >= 25 (Debian 12: apt-get install -t bookworm-backports mesa-vulkan-drivers "
              "libvulkan1, after adding 'deb http://deb.debian.org/debian bookworm-backports main' to the apt "
              "sources; `coordinatorctl envs install maniskill` does this when run as root); on a GPU host, the "
              "NVIDIA driver's Vulkan ICD (libnvidia-gl) and libvulkan1")


def instruction_for(env_id: str) -> str:
    if env_id in INSTRUCTIONS:
        return INSTRUCTIONS[env_id]
    import re

    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", env_id.rsplit("-v", 1)[0].replace("_", " "))
    return words.lower()


def _rlinf_message(env_id: str) -> str:
    return (f"maniskill: '{env_id}' is an earlier version of RLinf's task (RLinf's own task code), not of the "
            f"public mani-skill 3.0.1 package nor of rlfleet, which implements PutOnPlateInScene25Main-v3 (on "
            f"RLinf's assets). Use PutOnPlateInScene25Main-v3, a public task (PickCube-v1, PushCube-v1, "
            f"PutCarrotOnPlateInScene-v1, ...), or run RLinf's ManiSkill as an external env server "
            f"(cluster.external_env_addresses)")


# --- host checks -----------------------------------------------------------------------------------------------
ICD_DIRS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d")


def vulkan_problem() -> str | None:
    """Why SAPIEN cannot get a Vulkan device on this host (a cheap look at files, not a Vulkan call), or None."""
    if not ctypes.util.find_library("vulkan"):
        return "the Vulkan loader (libvulkan.so.1) is not installed. " + VULKAN_FIX
    listed = [f for v in ("VK_ICD_FILENAMES", "VK_DRIVER_FILES") for f in os.environ.get(v, "").split(os.pathsep) if f]
    icds = [f for f in listed if os.path.exists(f)] if listed else \
        [f for d in ICD_DIRS for f in glob.glob(os.path.join(d, "*.json"))]
    if not icds:
        where = "the files in VK_ICD_FILENAMES/VK_DRIVER_FILES" if listed else ", ".join(ICD_DIRS)
        return f"no Vulkan driver (ICD) is installed ({where}: none found). " + VULKAN_FIX
    if all("lvp_icd" in os.path.basename(f) for f in icds) and shutil.which("dpkg-query"):
        version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "mesa-vulkan-drivers"],
                                 capture_output=True, text=True).stdout.strip()
        if version and subprocess.run(["dpkg", "--compare-versions", version, "lt", "25"]).returncode == 0:
            return (f"the only Vulkan driver is Mesa {version} lavapipe, which SAPIEN rejects (Mesa >= 25 works). "
                    + VULKAN_FIX)
    return None


def preflight(cfg=None) -> None:
    """Fail fast (BackendUnavailable), from any environment, on a task id that cannot exist in the public package
    and on a host without a usable Vulkan driver."""
    if cfg is not None:
        for split in ("train", "eval"):
            e = cfg.env[split]
            if e.simulator_type != "maniskill":
                continue
            if e.env_id in RLINF_ONLY:
                raise BackendUnavailable(_rlinf_message(e.env_id))
            if e.env_id in put_on_plate_assets.TASKS:
                why = put_on_plate_assets.problem(e.env_id)
                if why:
                    raise BackendUnavailable(why)
    problem = vulkan_problem()
    if problem:
        raise BackendUnavailable(problem)


# --- ManiSkill import and task lookup --------------------------------------------------------------------------
class _AssetPrompt(Exception):
    """ManiSkill wanted to ask on stdin whether to download assets."""


def import_maniskill():
    """Import ManiSkill with its asset-download prompt turned into an error -> its task registry."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import mani_skill.envs  # noqa: F401  (registers the tasks)
            from mani_skill.utils import download_asset
            from mani_skill.utils.registration import REGISTERED_ENVS
    except ImportError as exc:
        raise BackendUnavailable(f"mani_skill is not installed in this environment ({exc}); env servers for "
                                 f"simulator_type=maniskill run from its own environment: "
                                 f"`coordinatorctl envs install maniskill`") from None

    def refuse(message: str) -> bool:
        raise _AssetPrompt(message)

    download_asset.prompt_yes_no = refuse  # never block on stdin (registration and agents call it by attribute)
    with contextlib.redirect_stdout(sys.stderr):  # rlfleet's own RLinf task (reads its assets when made)
        import services.env.backends.maniskill_put_on_plate  # noqa: F401  (registers it)
    return REGISTERED_ENVS


def _download_command(uid: str) -> str:
    return f"{sys.executable} -m mani_skill.utils.download_asset {uid} -y"


def enable_gpu_physx() -> None:
    """SAPIEN's GPU PhysX, or BackendUnavailable naming the library it lacks. SAPIEN fetches libPhysXGpu_64.so from
    a GitHub release on first use (in no wheel); a host that cannot reach it would otherwise fail with a
    ConnectionError traceback from inside the simulator's construction."""
    import pathlib

    from sapien import physx

    if physx.is_gpu_enabled():
        return
    folder = pathlib.Path.home() / ".sapien" / "physx" / physx.version()
    lib = folder / "libPhysXGpu_64.so"
    url = f"https://github.com/sapien-sim/physx-precompiled/releases/download/{physx.version()}/linux-so.zip"
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its download notice, kept off the env side's stdout
            physx.enable_gpu()
    except Exception as exc:
        state = "present but not loadable" if lib.is_file() else "missing"
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise BackendUnavailable(
            f"maniskill: sim_backend gpu needs SAPIEN's PhysX GPU library {lib} ({state}: {type(exc).__name__}: "
            f"{first}); SAPIEN downloads it from {url} on first use: fetch that zip where a network allows and unzip "
            f"it into {folder}, or use sim_backend cpu") from None


def missing_assets(env_id: str, robot_uids=None) -> list[tuple[str, list[str]]]:
    """[(download uid, missing data source ids)] for the task and its robot(s), as ManiSkill checks them."""
    import inspect

    from mani_skill.utils import assets
    from mani_skill.utils.registration import REGISTERED_ENVS

    spec = REGISTERED_ENVS[env_id]
    out: list[tuple[str, list[str]]] = []

    def missing(ids: Sequence[str]) -> list[str]:
        gone = []
        for uid in ids:
            sources = assets.expand_data_group_into_individual_data_source_ids(uid) if uid in assets.DATA_GROUPS \
                else [uid]
            gone += [s for s in sources if s in assets.DATA_SOURCES and not assets.is_data_source_downloaded(s)]
        return gone

    task = missing(spec.asset_download_ids or [])
    if task:
        out.append((env_id, task))
    if robot_uids is None:
        try:
            robot_uids = inspect.signature(spec.cls.__init__).parameters["robot_uids"].default
        except (KeyError, TypeError, ValueError):
            robot_uids = None
    from mani_skill.agents.registration import REGISTERED_AGENTS

    robots = robot_uids if isinstance(robot_uids, (list, tuple)) else [robot_uids]
    for robot in robots:  # a robot uid, or an agent class (its registration names its downloads)
        if isinstance(robot, type) and getattr(robot, "uid", None) in REGISTERED_AGENTS:
            for uid in REGISTERED_AGENTS[robot.uid].asset_download_ids:
                gone = missing(assets.DATA_GROUPS.get(uid, [uid]))
                if gone and uid not in [u for u, _ in out]:
                    out.append((uid, gone))
        elif isinstance(robot, str):
            gone = missing(assets.DATA_GROUPS.get(robot, []))
            if gone and robot not in [u for u, _ in out]:
                out.append((robot, gone))
    return out


def download_assets(task: str | None, dry_run: bool = False) -> int:
    """`coordinatorctl envs assets maniskill [TASK]`: ManiSkill's own download (``mani_skill.utils.download_asset``)
    of what TASK (and its robot) needs and does not have, into $MS_ASSET_DIR; with no TASK, the asset-backed tasks
    and which of them miss assets. Prints one line per step; -> exit code."""
    registry = import_maniskill()
    where = str(put_on_plate_assets.maniskill_data_dir())
    if task is None:
        backed = sorted(t for t, spec in registry.items() if spec.asset_download_ids)
        for t in backed:
            gone = [uid for uid, _ in missing_assets(t)]
            if t in put_on_plate_assets.TASKS and put_on_plate_assets.rlinf_missing():
                gone.append(f"RLinf's {put_on_plate_assets.RLINF_HUB_DATASET} set (`envs assets maniskill {t}` says how)")
            print(f"{t}: " + ("assets present" if not gone else "missing " + ", ".join(gone)))
        print(f"({len(backed)} asset-backed tasks; ManiSkill's data folder ($MS_ASSET_DIR/data): {where})")
        return 0
    if task in RLINF_ONLY:
        print(_rlinf_message(task))
        return 2
    if task not in registry:
        print(f"maniskill: unknown task '{task}'{did_you_mean(task, registry)}")
        return 2
    gone = missing_assets(task)
    rlinf = task in put_on_plate_assets.TASKS
    if not gone:
        print(f"{task}: every asset ManiSkill downloads for it is present in {where}")
        if rlinf:  # ... and RLinf's own set, which ManiSkill's downloader has no source for
            lines = put_on_plate_assets.rlinf_instructions(task)
            print("\n".join(lines))
            return 1 if put_on_plate_assets.problem(task) else 0
        return 0
    for uid, ids in gone:
        cmd = _download_command(uid)
        print(f"{task}: {uid} missing ({', '.join(ids[:3])}{' ...' if len(ids) > 3 else ''}): {cmd}", flush=True)
        if not dry_run:
            code = subprocess.run(cmd.split()).returncode
            if code != 0:
                print(f"{task}: the download of {uid} failed (exit {code}); where the network cannot reach ManiSkill's "
                      f"asset hosts, copy the assets into {where} from a machine that can")
                return 1
    if rlinf:
        print("\n".join(put_on_plate_assets.rlinf_instructions(task)))
        return 1 if not dry_run and put_on_plate_assets.problem(task) else 0
    return 0


def _sources_for(path: str) -> list[str]:
    """The ManiSkill data sources whose download holds ``path`` (a file ManiSkill did not find)."""
    from mani_skill.utils import assets

    found = []  # (root, uid) of every source containing the path
    for uid, src in assets.DATA_SOURCES.items():
        if src.target_path:
            root = os.path.abspath(os.path.join(str(src.output_dir), str(src.target_path)))
            if os.path.abspath(path).startswith(root + os.sep) or os.path.abspath(path) == root:
                found.append((root, uid))
    absent = [uid for root, uid in found if not os.path.exists(root)]
    return absent or [uid for _, uid in sorted(found, key=lambda f: -len(f[0]))[:1]]


def _assets_error(env_id: str, what: list[tuple[str, list[str]]] | str) -> BackendUnavailable:
    if isinstance(what, str):
        return BackendUnavailable(f"maniskill: {env_id} needs assets that are not downloaded ({what.strip()}); "
                                  f"download them with: {_download_command(env_id)} (into $MS_ASSET_DIR, default "
                                  f"~/.maniskill/data)")
    names = "; ".join(f"{uid}: {', '.join(ids[:3])}" + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
                      for uid, ids in what)
    cmds = " && ".join(_download_command(uid) for uid, _ in what)
    return BackendUnavailable(f"maniskill: {env_id} needs assets that are not downloaded ({names}); download them "
                              f"with: {cmds} (into $MS_ASSET_DIR, default ~/.maniskill/data)")


def _vulkan_error(env_id: str, exc: BaseException) -> BackendUnavailable | None:
    text = str(exc)
    if any(m in text for m in ("rendering device", "vk::", "Vulkan", "vulkan", "ErrorIncompatibleDriver")):
        return BackendUnavailable(f"maniskill: {env_id} could not start SAPIEN's renderer ({type(exc).__name__}: "
                                  f"{text}). {vulkan_problem() or VULKAN_FIX}")
    return None


def make_task(env_id: str, **kwargs):
    """One ManiSkill env (the task's class, without gymnasium's wrappers or ManiSkill's time limit); refuses,
    with the fix, a task id that does not exist and one whose assets are missing, never prompting."""
    registry = import_maniskill()
    if env_id in RLINF_ONLY:
        raise BackendUnavailable(_rlinf_message(env_id))
    if env_id not in registry:
        raise InvalidRequest(f"maniskill: unknown task '{env_id}'{did_you_mean(env_id, registry)}"
                             + f" ({len(registry)} tasks in mani-skill 3.0.1; e.g. PickCube-v1, PushCube-v1, "
                               f"StackCube-v1, PegInsertionSide-v1)")
    if env_id in put_on_plate_assets.TASKS:
        why = put_on_plate_assets.problem(env_id)
        if why:
            raise BackendUnavailable(why)
    gone = missing_assets(env_id, kwargs.get("robot_uids"))
    if gone:
        raise _assets_error(env_id, gone)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # ManiSkill prints what it finds missing
            return registry[env_id].make(**kwargs)
    except _AssetPrompt as exc:
        words = str(exc).split()
        if words[:1] == ["Robot"] and len(words) > 1:  # the robot's own assets (robot uid = its download id)
            raise _assets_error(env_id, [(words[1], [words[1]])]) from None
        raise _assets_error(env_id, str(exc)) from None
    except (EOFError, SystemExit) as exc:
        raise _assets_error(env_id, f"{type(exc).__name__} while ManiSkill looked for them") from None
    except FileNotFoundError as exc:  # scene datasets (ReplicaCAD, AI2-THOR, ...) are looked up without a prompt
        missing = str(exc.filename or "")
        from mani_skill import ASSET_DIR

        if not os.path.abspath(missing).startswith(os.path.abspath(str(ASSET_DIR))):
            raise
        uids = _sources_for(missing)
        how = " && ".join(_download_command(u) for u in uids) if uids else \
            f"{_download_command(env_id)} (`-l scene` / `-l task_assets` list the downloadable sets)"
        raise BackendUnavailable(f"maniskill: {env_id} needs assets that are not downloaded ({missing} is "
                                 f"missing); download them with: {how} (into $MS_ASSET_DIR, default "
                                 f"~/.maniskill/data)") from None
    except ImportError as exc:  # a task with extra requirements (DrawSVG-v1: svgpathtools)
        raise BackendUnavailable(f"maniskill: {env_id} needs a package the maniskill environment does not "
                                 f"install ({exc}); add it to MANISKILL_ENV.pip in rlfleet/simulators.py") from None
    except NotImplementedError as exc:  # an obs/reward mode the task does not support
        raise InvalidRequest(f"maniskill: {env_id}: {exc}") from None
    except AssertionError as exc:  # ManiSkill checks the control mode (and other arguments) by assert
        if "control_mode" in kwargs and "supported modes" in str(exc):
            raise InvalidRequest(f"maniskill: {env_id} has no control_mode {kwargs['control_mode']!r} ({exc})") \
                from None
        raise
    except RuntimeError as exc:
        err = _vulkan_error(env_id, exc)
        if err:
            raise err from None
        if "download_asset" in str(exc):  # e.g. "Partnet Mobility dataset not found. Download it by running ..."
            raise BackendUnavailable(f"maniskill: {env_id} needs assets that are not downloaded: {exc} (with this "
                                     f"environment's python: {sys.executable}; add -y to skip the prompt)") from None
        raise


def check_install() -> None:
    """The maniskill environment's build check: a PushCube-v1 is created, reset and stepped on the CPU."""
    import torch

    problem = vulkan_problem()
    if problem:
        raise SystemExit(f"maniskill: {problem}")
    env = make_task("PushCube-v1", obs_mode="state", sim_backend="physx_cpu", render_backend="cpu")
    env.reset(seed=0)
    env.step(torch.zeros(env.single_action_space.shape))
    env.close()
    import mani_skill
    import sapien

    print(f"maniskill: PushCube-v1 created, reset and stepped (mani-skill {mani_skill.__version__}, sapien "
          f"{sapien.__version__}, torch {torch.__version__})")


# --- the backend -----------------------------------------------------------------------------------------------
def _flatten(node, out: list) -> None:
    """ManiSkill's observation dict entries, depth first in its order, as flat float32 rows [B, k]."""
    if isinstance(node, dict):
        for v in node.values():
            _flatten(v, out)
    else:
        t = node.detach().cpu().numpy() if hasattr(node, "detach") else np.asarray(node)
        out.append(t.reshape(t.shape[0], -1).astype(np.float32))


class ManiSkillBackend(SimBackend):
    name = "maniskill"

    def __init__(self, env_id: str, num_envs: int, *, obs_mode: str = "state", image_size=64,
                 camera: str | None = None, control_mode: str | None = None, reward_mode: str | None = None,
                 sim_backend: str = "auto", env_kwargs: dict | None = None, **unknown):
        super().__init__(env_id, num_envs)
        if unknown:
            raise InvalidRequest(f"maniskill: unknown init_params {sorted(unknown)} (known: {', '.join(PARAMS)})")
        if obs_mode not in ("state", "rgb"):
            raise InvalidRequest(f"maniskill: obs_mode must be state or rgb, got {obs_mode!r}")
        size = list(image_size) if isinstance(image_size, (list, tuple)) else [image_size, image_size]
        if len(size) != 2 or not all(8 <= int(s) <= 2048 for s in size):
            raise InvalidRequest(f"maniskill: image_size must be S or [H, W] with sizes in [8, 2048], got {image_size}")
        self.height, self.width = int(size[0]), int(size[1])
        import torch

        backend = {"cpu": "physx_cpu", "physx_cpu": "physx_cpu", "gpu": "physx_cuda", "cuda": "physx_cuda",
                   "physx_cuda": "physx_cuda"}.get(sim_backend)
        if sim_backend == "auto":
            backend = "physx_cuda" if torch.cuda.is_available() else "physx_cpu"
        if backend is None:
            raise InvalidRequest(f"maniskill: sim_backend must be auto, cpu or gpu, got {sim_backend!r}")
        if backend == "physx_cuda" and not torch.cuda.is_available():
            raise BackendUnavailable("maniskill: sim_backend gpu needs a CUDA GPU visible to torch; this process "
                                     "has none (use sim_backend cpu or auto)")
        self.gpu = backend == "physx_cuda"
        if self.gpu:
            enable_gpu_physx()
        self.obs_mode, self.camera = obs_mode, camera
        self._torch = torch
        kwargs = dict(env_kwargs or {})
        spec = import_maniskill().get(env_id)
        if reward_mode is None:  # normalized_dense where the task has it (most do), else the task's own default
            modes = getattr(spec.cls, "SUPPORTED_REWARD_MODES", ()) if spec else ()
            reward_mode = "normalized_dense" if not modes or "normalized_dense" in modes else modes[0]
        obs_modes = getattr(spec.cls, "SUPPORTED_OBS_MODES", ()) if spec else ()
        # the Bridge digital twins: rgb with their greenscreen background, at their camera's own size
        self.resize = obs_mode == "rgb" and "rgb" not in obs_modes and "rgb+segmentation" in obs_modes
        kwargs.update(obs_mode="rgb+segmentation" if self.resize else obs_mode, reward_mode=reward_mode,
                      sim_backend=backend, render_mode=None, num_envs=num_envs if self.gpu else 1)
        if control_mode is not None:
            kwargs["control_mode"] = control_mode
        if obs_mode == "rgb" and not self.resize:
            kwargs["sensor_configs"] = {**kwargs.get("sensor_configs", {}), "width": self.width, "height": self.height}
        # a renderer even for state observations: some tasks (PushT) build render shapes; SAPIEN needs Vulkan anyway
        kwargs.setdefault("render_backend", "gpu" if self.gpu else "cpu")
        self.envs = []
        try:
            for _ in range(1 if self.gpu else num_envs):
                self.envs.append(make_task(env_id, **kwargs))
        except Exception:
            self.close()
            raise
        env = self.envs[0]
        if not hasattr(env.single_action_space, "shape") or env.single_action_space.shape is None:
            self.close()
            raise InvalidRequest(f"maniskill: {env_id} has a {type(env.single_action_space).__name__} action space "
                                 f"(several agents); this backend drives tasks with one Box action")
        self.control_mode = env.control_mode
        from mani_skill.utils.registration import REGISTERED_ENVS

        self.instruction = instruction_for(env_id)
        self._per_episode_text = callable(getattr(env.unwrapped, "get_language_instruction", None))
        first = self._rows(env._init_raw_obs if hasattr(env, "_init_raw_obs") else env.reset(seed=0)[0])
        obs_space = {"state": TensorSpace((first["state"].shape[1],), np.float32)}
        if obs_mode == "rgb":
            obs_space["pixels"] = TensorSpace((self.height, self.width, 3), np.uint8, 0, 255)
        self.observation_space = obs_space
        self.action_space = TensorSpace.from_gym(env.single_action_space)
        self.max_episode_steps = int(REGISTERED_ENVS[env_id].max_episode_steps or 1000)
        # tasks with enumerated episodes (PutOnPlateInScene25Main-v3's episode ids) offer them as fixed states
        self.num_reset_states = int(getattr(env.unwrapped, "total_num_trials", 0) or 0)
        self._rngs = [np.random.default_rng(i) for i in range(num_envs)]

    # --- observations -------------------------------------------------------------------------------------
    def _rows(self, obs) -> dict[str, np.ndarray]:
        """One ManiSkill observation (a batch of B envs) -> {"state": [B, D], "pixels": [B, H, W, 3]}."""
        if self.obs_mode == "state":
            return {"state": obs.detach().cpu().numpy().astype(np.float32).reshape(obs.shape[0], -1)}
        parts: list[np.ndarray] = []
        for key in ("agent", "extra"):
            if key in obs:
                _flatten(obs[key], parts)
        sensors = obs["sensor_data"]
        name = self.camera or next(iter(sensors))
        if name not in sensors:
            raise InvalidRequest(f"maniskill: {self.env_id} has no camera {name!r} (cameras: {', '.join(sensors)})")
        rgb = sensors[name]["rgb"].detach().cpu().numpy()[..., :3]
        if rgb.shape[1:3] != (self.height, self.width):
            import cv2

            rgb = np.stack([cv2.resize(np.ascontiguousarray(im, dtype=np.uint8), (self.width, self.height),
                                       interpolation=cv2.INTER_AREA) for im in rgb])
        batch = rgb.shape[0]
        state = np.concatenate(parts, axis=1) if parts else np.zeros((batch, 0), np.float32)
        return {"state": state, "pixels": np.ascontiguousarray(rgb, dtype=np.uint8)}

    # --- reset and step -----------------------------------------------------------------------------------
    def _seed(self, slot: int, seed: int | None) -> int:
        if seed is not None:
            self._rngs[slot] = np.random.default_rng(int(seed))
            return int(seed) % (2 ** 31)
        return int(self._rngs[slot].integers(2 ** 31))

    def _text(self, slot: int) -> str:
        if not self._per_episode_text:
            return self.instruction
        env = self.envs[0] if self.gpu else self.envs[slot]
        texts = env.unwrapped.get_language_instruction()
        return str(texts[slot if self.gpu else 0])

    def reset(self, env_ids, seeds, state_ids):
        if any(s is not None for s in state_ids) and not self.num_reset_states:
            raise InvalidRequest("maniskill: no fixed initial states (num_reset_states is 0)")
        rows, texts = [], []
        for i, seed, state in zip(env_ids, seeds, state_ids):
            s = self._seed(int(i), seed)
            options = {} if state is None else {"episode_id": int(state)}
            if self.gpu:  # one slot at a time: a batched reset seeds one RNG for all the slots it resets
                idx = self._torch.tensor([int(i)], device=self.envs[0].device)
                obs, _ = self.envs[0].reset(seed=[s], options={"env_idx": idx, **options})
                row = {k: v[int(i):int(i) + 1] for k, v in self._rows(obs).items()}
            else:
                obs, _ = self.envs[int(i)].reset(seed=s, options=options)
                row = self._rows(obs)
            rows.append(row)
            texts.append(self._text(int(i)))
        out = {k: np.concatenate([r[k] for r in rows]) for k in self.observation_space}
        return out, texts

    def drawn_state_ids(self, env_ids):
        if not self.num_reset_states:
            return [None] * len(env_ids)
        if self.gpu:
            return [int(self.envs[0].unwrapped.episode_ids[int(i)]) for i in env_ids]
        return [int(self.envs[int(i)].unwrapped.episode_ids[0]) for i in env_ids]

    def step(self, env_ids, actions) -> StepResult:
        if self.gpu:
            return self._step_batched(np.asarray(env_ids), actions)
        n = len(env_ids)
        rows, rewards = [], np.zeros(n, np.float32)
        terminated, success = np.zeros(n, bool), np.zeros(n, bool)
        for j, i in enumerate(env_ids):
            obs, reward, term, _, info = self.envs[int(i)].step(self._torch.from_numpy(np.asarray(actions[j])))
            rows.append(self._rows(obs))
            rewards[j], terminated[j] = float(reward.reshape(-1)[0]), bool(term.reshape(-1)[0])
            if "success" in info:
                success[j] = bool(info["success"].reshape(-1)[0])
        obs = {k: np.concatenate([r[k] for r in rows]) for k in self.observation_space}
        return StepResult(obs, rewards, terminated, np.zeros(n, bool), success)

    def _step_batched(self, env_ids: np.ndarray, actions) -> StepResult:
        torch, env = self._torch, self.envs[0]
        full = np.zeros((self.num_envs, *self.action_space.shape), np.float32)
        full[env_ids] = actions
        others = np.setdiff1d(np.arange(self.num_envs), env_ids)
        saved = env.get_state() if len(others) else None  # the slots not stepped keep their simulation state
        obs, reward, term, _, info = env.step(torch.from_numpy(full).to(env.device))
        if saved is not None:
            idx = torch.from_numpy(others).to(env.device)
            env.set_state(saved[idx], env_idx=idx)
            env._elapsed_steps[idx] -= 1
        rows = self._rows(obs)
        obs_rows = {k: v[env_ids] for k, v in rows.items()}
        reward = reward.detach().cpu().numpy().reshape(-1)[env_ids].astype(np.float32)
        term = term.detach().cpu().numpy().reshape(-1)[env_ids].astype(bool)
        success = info["success"].detach().cpu().numpy().reshape(-1)[env_ids].astype(bool) if "success" in info \
            else np.zeros(len(env_ids), bool)
        return StepResult(obs_rows, reward, term, np.zeros(len(env_ids), bool), success)

    def close(self) -> None:
        for env in getattr(self, "envs", []):
            with contextlib.suppress(Exception):
                env.close()
        self.envs = []

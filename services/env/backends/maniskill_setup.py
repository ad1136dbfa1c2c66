"""ManiSkill3's host side (the backend is services.env.backends.maniskill, which imports this module, never the
other way round): what the env side's table (services.env.backends) runs outside a backend and what the backend
needs from the host.

- host checks: ``preflight`` (from any environment, the main one included: no simulator import) refuses a task id
  that cannot exist in the public package (RLinf's earlier versions of its own task), RLinf's task without its
  assets, and a host without a usable Vulkan driver (``vulkan_problem``);
- importing ManiSkill with its asset-download prompt turned into an error (``import_maniskill``; it also registers
  rlfleet's own PutOnPlateInScene25Main-v3, services.env.backends.maniskill_put_on_plate), SAPIEN's GPU PhysX
  (``enable_gpu_physx``), and making a task (``make_task``): refused, with the fix, when its id does not exist or its
  assets are missing, never prompting;
- finishing the maniskill environment (``check_install``: a PushCube-v1 created, reset and stepped) and fetching a
  task's assets (``download_assets``: `coordinatorctl envs assets maniskill [TASK]`).
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

from rlfleet.errors import InvalidRequest
from rlfleet.registry import did_you_mean
from services.env.backends import put_on_plate_assets
from services.env.backends.base import BackendUnavailable

# RLinf's ManiSkill task ids that rlfleet does not implement (RLinf's earlier versions of its own task)
RLINF_ONLY = ("PutOnPlateInScene25Main-v2", "PutOnPlateInScene25Main-v1")
VULKAN_FIX = (
    "SAPIEN (ManiSkill's simulator) needs a Vulkan driver even for state observations. On a CPU host "
    "that is Mesa's lavapipe >= 25 (Debian 12: apt-get install -t bookworm-backports mesa-vulkan-drivers "
    "libvulkan1, after adding 'deb http://deb.debian.org/debian bookworm-backports main' to the apt "
    "sources; `coordinatorctl envs install maniskill` does this when run as root); on a GPU host, the "
    "NVIDIA driver's Vulkan ICD (libnvidia-gl) and libvulkan1"
)


def _rlinf_message(env_id: str) -> str:
    return (
        f"maniskill: '{env_id}' is an earlier version of RLinf's task (RLinf's own task code), not of the "
        f"public mani-skill 3.0.1 package nor of rlfleet, which implements PutOnPlateInScene25Main-v3 (on "
        f"RLinf's assets). Use PutOnPlateInScene25Main-v3, a public task (PickCube-v1, PushCube-v1, "
        f"PutCarrotOnPlateInScene-v1, ...), or run RLinf's ManiSkill as an external env server "
        f"(cluster.external_env_addresses)"
    )


# --- host checks -----------------------------------------------------------------------------------------------
ICD_DIRS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d")


def vulkan_problem() -> str | None:
    """Why SAPIEN cannot get a Vulkan device on this host (a cheap look at files, not a Vulkan call), or None."""
    if not ctypes.util.find_library("vulkan"):
        return "the Vulkan loader (libvulkan.so.1) is not installed. " + VULKAN_FIX
    listed = [f for v in ("VK_ICD_FILENAMES", "VK_DRIVER_FILES") for f in os.environ.get(v, "").split(os.pathsep) if f]
    icds = (
        [f for f in listed if os.path.exists(f)]
        if listed
        else [f for d in ICD_DIRS for f in glob.glob(os.path.join(d, "*.json"))]
    )
    if not icds:
        where = "the files in VK_ICD_FILENAMES/VK_DRIVER_FILES" if listed else ", ".join(ICD_DIRS)
        return f"no Vulkan driver (ICD) is installed ({where}: none found). " + VULKAN_FIX
    if all("lvp_icd" in os.path.basename(f) for f in icds) and shutil.which("dpkg-query"):
        version = subprocess.run(
            ["dpkg-query", "-W", "-f", "${Version}", "mesa-vulkan-drivers"], capture_output=True, text=True
        ).stdout.strip()
        if version and subprocess.run(["dpkg", "--compare-versions", version, "lt", "25"]).returncode == 0:
            return (
                f"the only Vulkan driver is Mesa {version} lavapipe, which SAPIEN rejects (Mesa >= 25 works). "
                + VULKAN_FIX
            )
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
        raise BackendUnavailable(
            f"mani_skill is not installed in this environment ({exc}); env servers for "
            f"simulator_type=maniskill run from its own environment: "
            f"`coordinatorctl envs install maniskill`"
        ) from None

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
            f"it into {folder}, or use sim_backend cpu"
        ) from None


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
            sources = (
                assets.expand_data_group_into_individual_data_source_ids(uid) if uid in assets.DATA_GROUPS else [uid]
            )
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
                gone.append(
                    f"RLinf's {put_on_plate_assets.RLINF_HUB_DATASET} set (`envs assets maniskill {t}` says how)"
                )
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
                print(
                    f"{task}: the download of {uid} failed (exit {code}); where the network cannot reach ManiSkill's "
                    f"asset hosts, copy the assets into {where} from a machine that can"
                )
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
        return BackendUnavailable(
            f"maniskill: {env_id} needs assets that are not downloaded ({what.strip()}); "
            f"download them with: {_download_command(env_id)} (into $MS_ASSET_DIR, default "
            f"~/.maniskill/data)"
        )
    names = "; ".join(
        f"{uid}: {', '.join(ids[:3])}" + (f" and {len(ids) - 3} more" if len(ids) > 3 else "") for uid, ids in what
    )
    cmds = " && ".join(_download_command(uid) for uid, _ in what)
    return BackendUnavailable(
        f"maniskill: {env_id} needs assets that are not downloaded ({names}); download them "
        f"with: {cmds} (into $MS_ASSET_DIR, default ~/.maniskill/data)"
    )


def _vulkan_error(env_id: str, exc: BaseException) -> BackendUnavailable | None:
    text = str(exc)
    if any(m in text for m in ("rendering device", "vk::", "Vulkan", "vulkan", "ErrorIncompatibleDriver")):
        return BackendUnavailable(
            f"maniskill: {env_id} could not start SAPIEN's renderer ({type(exc).__name__}: "
            f"{text}). {vulkan_problem() or VULKAN_FIX}"
        )
    return None


def make_task(env_id: str, **kwargs):
    """One ManiSkill env (the task's class, without gymnasium's wrappers or ManiSkill's time limit); refuses,
    with the fix, a task id that does not exist and one whose assets are missing, never prompting."""
    registry = import_maniskill()
    if env_id in RLINF_ONLY:
        raise BackendUnavailable(_rlinf_message(env_id))
    if env_id not in registry:
        raise InvalidRequest(
            f"maniskill: unknown task '{env_id}'{did_you_mean(env_id, registry)}"
            + f" ({len(registry)} tasks in mani-skill 3.0.1; e.g. PickCube-v1, PushCube-v1, "
            f"StackCube-v1, PegInsertionSide-v1)"
        )
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
        how = (
            " && ".join(_download_command(u) for u in uids)
            if uids
            else f"{_download_command(env_id)} (`-l scene` / `-l task_assets` list the downloadable sets)"
        )
        raise BackendUnavailable(
            f"maniskill: {env_id} needs assets that are not downloaded ({missing} is "
            f"missing); download them with: {how} (into $MS_ASSET_DIR, default "
            f"~/.maniskill/data)"
        ) from None
    except ImportError as exc:  # a task with extra requirements (DrawSVG-v1: svgpathtools)
        raise BackendUnavailable(
            f"maniskill: {env_id} needs a package the maniskill environment does not "
            f"install ({exc}); add it to MANISKILL_ENV.pip in rlfleet/simulators.py"
        ) from None
    except NotImplementedError as exc:  # an obs/reward mode the task does not support
        raise InvalidRequest(f"maniskill: {env_id}: {exc}") from None
    except AssertionError as exc:  # ManiSkill checks the control mode (and other arguments) by assert
        if "control_mode" in kwargs and "supported modes" in str(exc):
            raise InvalidRequest(
                f"maniskill: {env_id} has no control_mode {kwargs['control_mode']!r} ({exc})"
            ) from None
        raise
    except RuntimeError as exc:
        err = _vulkan_error(env_id, exc)
        if err:
            raise err from None
        if "download_asset" in str(exc):  # e.g. "Partnet Mobility dataset not found. Download it by running ..."
            raise BackendUnavailable(
                f"maniskill: {env_id} needs assets that are not downloaded: {exc} (with this "
                f"environment's python: {sys.executable}; add -y to skip the prompt)"
            ) from None
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

    print(
        f"maniskill: PushCube-v1 created, reset and stepped (mani-skill {mani_skill.__version__}, sapien "
        f"{sapien.__version__}, torch {torch.__version__})"
    )

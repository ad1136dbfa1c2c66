"""Where ``PutOnPlateInScene25Main-v3`` (rlfleet's implementation of RLinf's ManiSkill task) finds its assets, and
what is missing: plain file checks, no ManiSkill import, so the preflight can run them from the main environment.

Two sets, in the layouts their owners use:

- ManiSkill's own downloads, under ManiSkill's data folder (``$MS_ASSET_DIR/data``, default ``~/.maniskill/data``):
  the WidowX 250S robot (``widowx250s``: ``robots/widowx/wx250s.urdf``) and the Bridge real2sim set
  (``bridge_v2_real2sim``: ``tasks/bridge_v2_real2sim_dataset/stages/bridge_table_1_v1.glb``, the table scene).
- RLinf's task assets (the ``RLinf/maniskill_assets`` dataset on the Hugging Face hub, which RLinf downloads into
  its ``assets`` folder), under ``$MANISKILL_ASSET_DIR`` where set (RLinf's own variable), else ManiSkill's data
  folder::

      carrot/more_carrot/model_db.json            {model: {"name": "<words>", "bbox": {"min": [3], "max": [3]},
                                                           "scale"?: [..], "density"?: kg/m3}}
      carrot/more_carrot/<model>/collision.obj     convex parts; visual: textured.obj, .dae or .glb
      carrot/more_plate/model_db.json, <model>/    the same; the task uses the first plate
      carrot/more_table/model_db.json              {image: {"texture": "<file>", "mix": float}}
      carrot/more_table/imgs/<image>               the backgrounds overlaid on the camera (greenscreen)
      carrot/more_table/textures/<texture>        (RLinf's loader reads these too; this task does not)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TASKS = ("PutOnPlateInScene25Main-v3",)
RLINF_HUB_DATASET = "RLinf/maniskill_assets"
ROBOT_FILE = "robots/widowx/wx250s.urdf"
STAGE_FILE = "tasks/bridge_v2_real2sim_dataset/stages/bridge_table_1_v1.glb"
VISUALS = ("textured.obj", "textured.dae", "textured.glb")


def maniskill_data_dir() -> Path:
    """ManiSkill's ASSET_DIR, computed as mani_skill computes it ($MS_ASSET_DIR/data, default ~/.maniskill/data)."""
    return Path(os.environ.get("MS_ASSET_DIR", os.path.join(os.path.expanduser("~"), ".maniskill"))) / "data"


def rlinf_asset_dir() -> Path:
    """The folder holding RLinf's ``carrot/`` set: $MANISKILL_ASSET_DIR (RLinf's variable), else ManiSkill's."""
    return Path(os.environ["MANISKILL_ASSET_DIR"]) if os.environ.get("MANISKILL_ASSET_DIR") else maniskill_data_dir()


def carrot_dir() -> Path:
    return rlinf_asset_dir() / "carrot"


def load_db(kind: str) -> dict:
    """One model database (``more_carrot``, ``more_plate``, ``more_table``), in its file's order."""
    with open(carrot_dir() / kind / "model_db.json") as f:
        return json.load(f)


def visual_file(model_dir: Path) -> Path | None:
    return next((model_dir / v for v in VISUALS if (model_dir / v).exists()), None)


def _missing_rlinf() -> list[str]:
    """The missing files of RLinf's set (at most a few named, then a count)."""
    gone: list[str] = []
    root = carrot_dir()
    for kind in ("more_carrot", "more_plate", "more_table"):
        path = root / kind / "model_db.json"
        if not path.is_file():
            gone.append(str(path))
            continue
        try:
            db = load_db(kind)
        except (OSError, ValueError) as exc:
            gone.append(f"{path} (unreadable: {exc})")
            continue
        if not db:
            gone.append(f"{path} (no entries)")
        entries = list(db.items())[:1] if kind == "more_plate" else list(db.items())
        for name, entry in entries:
            if kind == "more_table":
                if not (root / kind / "imgs" / name).is_file():
                    gone.append(str(root / kind / "imgs" / name))
            else:
                folder = root / kind / name
                if not (folder / "collision.obj").is_file():
                    gone.append(str(folder / "collision.obj"))
                if visual_file(folder) is None:
                    gone.append(str(folder / "textured.{obj,dae,glb}"))
                if "bbox" not in entry:
                    gone.append(f"{path}: '{name}' has no bbox")
    return gone


def rlinf_missing() -> bool:
    return bool(_missing_rlinf())


def _missing_maniskill() -> list[str]:
    data = maniskill_data_dir()
    return [str(data / f) for f in (ROBOT_FILE, STAGE_FILE) if not (data / f).is_file()]


def _names(paths: list[str]) -> str:
    return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def problem(env_id: str) -> str | None:
    """One line naming what ``env_id`` lacks and how to get it, or None when every asset it reads is present."""
    rlinf, maniskill = _missing_rlinf(), _missing_maniskill()
    if not rlinf and not maniskill:
        return None
    parts = []
    if rlinf:
        parts.append(
            f"RLinf's task assets are missing ({_names(rlinf)}): download RLinf's set with `hf download "
            f"--repo-type dataset {RLINF_HUB_DATASET} --local-dir {rlinf_asset_dir()}` (or set "
            f"MANISKILL_ASSET_DIR to the folder that holds its carrot/)"
        )
    if maniskill:
        parts.append(
            f"ManiSkill's WidowX/Bridge assets are missing ({_names(maniskill)}): `coordinatorctl envs "
            f"assets maniskill {env_id}` downloads them"
        )
    return f"maniskill: {env_id} needs its assets: " + "; ".join(parts)


def rlinf_instructions(env_id: str) -> list[str]:
    """What `coordinatorctl envs assets maniskill TASK` prints for RLinf's part, which ManiSkill cannot download."""
    gone = _missing_rlinf()
    if not gone:
        return [f"{env_id}: RLinf's task assets are present in {carrot_dir()}"]
    return [
        f"{env_id}: RLinf's task assets (objects, plate, table overlays) are missing ({_names(gone)}); "
        f"ManiSkill's downloader has no source for them. Download RLinf's set (the Hugging Face dataset "
        f"{RLINF_HUB_DATASET}) with: hf download --repo-type dataset {RLINF_HUB_DATASET} --local-dir "
        f"{rlinf_asset_dir()}   (or copy an existing RLinf assets folder, the one holding carrot/, there; or "
        f"set MANISKILL_ASSET_DIR to it)"
    ]

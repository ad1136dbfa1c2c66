"""A small asset set for ``PutOnPlateInScene25Main-v3`` in the layout the task reads (the real one: RLinf's
``RLinf/maniskill_assets`` plus ManiSkill's ``widowx250s`` and ``bridge_v2_real2sim`` downloads), written by the
tests since none of them can be downloaded here:

    <MS_ASSET_DIR>/data/carrot/more_carrot/model_db.json + <model>/collision.obj, textured.obj   (3 objects)
    <MS_ASSET_DIR>/data/carrot/more_plate/model_db.json + <model>/...                          (1 plate)
    <MS_ASSET_DIR>/data/carrot/more_table/model_db.json + imgs/*.png, textures/*.png           (2 backgrounds)
    <MS_ASSET_DIR>/data/tasks/bridge_v2_real2sim_dataset/stages/bridge_table_1_v1.glb          (a table, y-up)
    <MS_ASSET_DIR>/data/robots/widowx/wx250s.urdf      (a stand-in WidowX 250S: its joints, links and rough
                                                         dimensions, primitive shapes)

Run it with the maniskill environment's python (it uses trimesh, which mani-skill installs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# model id -> (the name the instruction uses, shape, size in m, RGBA)
OBJECTS = {
    "green_cube": ("green cube", "box", (0.04, 0.04, 0.04), (40, 180, 60, 255)),
    "red_can": ("red can", "cylinder", (0.018, 0.05), (200, 30, 30, 255)),
    "yellow_block": ("yellow block", "box", (0.06, 0.03, 0.03), (230, 200, 30, 255)),
}
PLATE = ("plate_white", "plate", (0.08, 0.012), (235, 235, 235, 255))
BACKGROUNDS = {"bg_wood.png": (150, 110, 70), "bg_blue.png": (60, 90, 160)}
TABLE_TOP = 0.865  # world z of the table top (the robot's base sits at z 0.87)
STAGE_OFFSET = np.array([2.0634, 2.8313, 0.0])  # where the task places the stage (the Bridge scan's offset)


def _mesh(shape: str, size, rgba):
    import trimesh

    if shape == "box":
        mesh = trimesh.creation.box(extents=size)
    else:  # cylinder / plate: radius, height
        mesh = trimesh.creation.cylinder(radius=size[0], height=size[1], sections=32)
    mesh.visual.face_colors = np.tile(np.array(rgba, np.uint8), (len(mesh.faces), 1))
    return mesh


def _write_model(folder: Path, shape: str, size, rgba) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    mesh = _mesh(shape, size, rgba)
    mesh.export(folder / "collision.obj", include_color=False, include_texture=False)
    # the visual: the same mesh with a coloured material (a .mtl beside it)
    body = (folder / "collision.obj").read_text()
    (folder / "textured.mtl").write_text("newmtl colour\nKd " + " ".join(f"{c / 255:.3f}" for c in rgba[:3]) + "\n")
    (folder / "textured.obj").write_text("mtllib textured.mtl\nusemtl colour\n" + body)
    lo, hi = mesh.bounds
    return {"bbox": {"min": lo.tolist(), "max": hi.tolist()}, "scale": [1.0], "density": 500}


def _stage(path: Path) -> None:
    """A table (and a floor) in the scan's y-up frame: the task turns it +90 degrees about x and moves it by
    STAGE_OFFSET, so world (x, y, z) = (lx, -lz, ly) + offset."""
    import trimesh

    def box(world_center, world_size, rgb):
        c = np.asarray(world_center, float) - STAGE_OFFSET
        m = trimesh.creation.box(extents=(world_size[0], world_size[2], world_size[1]))
        m.apply_translation((c[0], c[2], -c[1]))
        m.visual.face_colors = np.tile(np.array([*rgb, 255], np.uint8), (len(m.faces), 1))
        return m

    table = box((-0.1, 0.0, TABLE_TOP - 0.025), (0.8, 0.8, 0.05), (170, 150, 120))
    floor = box((0.0, 0.0, -0.01), (4.0, 4.0, 0.02), (90, 90, 90))
    path.parent.mkdir(parents=True, exist_ok=True)
    trimesh.util.concatenate([table, floor]).export(path)


def _link(
    name: str,
    geometry: str | None = None,
    origin=(0, 0, 0),
    collide: bool = False,
    mass: float = 0.2,
    rgba: str = "0.2 0.2 0.2 1",
) -> str:
    xyz = " ".join(str(v) for v in origin)
    shape = ""
    if geometry:
        shape = (
            f'<visual><origin xyz="{xyz}"/><geometry>{geometry}</geometry>'
            f'<material name="{name}_m"><color rgba="{rgba}"/></material></visual>'
        )
        if collide:
            shape += f'<collision><origin xyz="{xyz}"/><geometry>{geometry}</geometry></collision>'
    return (
        f'<link name="{name}"><inertial><origin xyz="{xyz}"/><mass value="{mass}"/>'
        f'<inertia ixx="1e-4" ixy="0" ixz="0" iyy="1e-4" iyz="0" izz="1e-4"/></inertial>{shape}</link>'
    )


def _joint(name: str, kind: str, parent: str, child: str, origin, axis=(0, 0, 1), limits=(-3.14, 3.14)) -> str:
    out = (
        f'<joint name="{name}" type="{kind}"><parent link="{parent}"/><child link="{child}"/>'
        f'<origin xyz="{" ".join(str(v) for v in origin)}"/>'
    )
    if kind != "fixed":
        out += (
            f'<axis xyz="{" ".join(str(v) for v in axis)}"/>'
            f'<limit lower="{limits[0]}" upper="{limits[1]}" effort="100" velocity="3"/>'
        )
    return out + "</joint>"


def stand_in_widowx() -> str:
    """A WidowX 250S with the joint and link names ManiSkill's agent and controllers use, at roughly its
    dimensions (Interbotix wx250s), as boxes and cylinders; only the fingers collide."""
    cyl = '<cylinder radius="0.02" length="{}"/>'
    links = [
        _link("base_link", '<box size="0.12 0.12 0.07"/>', (0, 0, 0.035), mass=1.0),
        _link("shoulder_link", cyl.format(0.04), (0, 0, 0.02)),
        _link("upper_arm_link", '<box size="0.04 0.04 0.25"/>', (0.025, 0, 0.125)),
        _link("upper_forearm_link", '<box size="0.175 0.035 0.035"/>', (0.0875, 0, 0)),
        _link("lower_forearm_link", '<box size="0.075 0.03 0.03"/>', (0.0375, 0, 0)),
        _link("wrist_link", '<box size="0.065 0.03 0.03"/>', (0.0325, 0, 0)),
        _link("gripper_link", '<box size="0.043 0.05 0.03"/>', (0.0215, 0, 0)),
        _link("ee_arm_link"),
        _link("gripper_bar_link", '<box size="0.01 0.09 0.02"/>', (0, 0, 0)),
        _link("fingers_link"),
        _link(
            "left_finger_link",
            '<box size="0.04 0.01 0.02"/>',
            (0.02, 0.005, 0),
            collide=True,
            mass=0.05,
            rgba="0.8 0.8 0.8 1",
        ),
        _link(
            "right_finger_link",
            '<box size="0.04 0.01 0.02"/>',
            (0.02, -0.005, 0),
            collide=True,
            mass=0.05,
            rgba="0.8 0.8 0.8 1",
        ),
        _link("ee_gripper_link"),
    ]
    joints = [
        _joint("waist", "revolute", "base_link", "shoulder_link", (0, 0, 0.072), (0, 0, 1)),
        _joint("shoulder", "revolute", "shoulder_link", "upper_arm_link", (0, 0, 0.03865), (0, 1, 0), (-1.88, 1.99)),
        _joint(
            "elbow", "revolute", "upper_arm_link", "upper_forearm_link", (0.04975, 0, 0.25), (0, 1, 0), (-2.15, 1.6)
        ),
        _joint("forearm_roll", "revolute", "upper_forearm_link", "lower_forearm_link", (0.175, 0, 0), (1, 0, 0)),
        _joint("wrist_angle", "revolute", "lower_forearm_link", "wrist_link", (0.075, 0, 0), (0, 1, 0), (-1.75, 2.15)),
        _joint("wrist_rotate", "revolute", "wrist_link", "gripper_link", (0.065, 0, 0), (1, 0, 0)),
        _joint("ee_arm", "fixed", "gripper_link", "ee_arm_link", (0.043, 0, 0)),
        _joint("gripper_bar", "fixed", "ee_arm_link", "gripper_bar_link", (0, 0, 0)),
        _joint("ee_bar", "fixed", "gripper_bar_link", "fingers_link", (0.023, 0, 0)),
        _joint("left_finger", "prismatic", "fingers_link", "left_finger_link", (0, 0, 0), (0, 1, 0), (0.015, 0.037)),
        _joint("right_finger", "prismatic", "fingers_link", "right_finger_link", (0, 0, 0), (0, -1, 0), (0.015, 0.037)),
        _joint("ee_gripper", "fixed", "fingers_link", "ee_gripper_link", (0.027575, 0, 0)),
    ]
    return '<?xml version="1.0"?>\n<robot name="wx250s">' + "".join(links + joints) + "</robot>\n"


def build(ms_asset_dir: str | Path) -> Path:
    """Write the set under ``ms_asset_dir`` (what MS_ASSET_DIR is set to) -> ManiSkill's data folder."""
    import cv2

    data = Path(ms_asset_dir) / "data"
    carrot = data / "carrot"
    db = {}
    for model, (name, shape, size, rgba) in OBJECTS.items():
        db[model] = {"name": name, **_write_model(carrot / "more_carrot" / model, shape, size, rgba)}
    (carrot / "more_carrot" / "model_db.json").write_text(json.dumps(db, indent=1))
    model, shape, size, rgba = PLATE
    plate = {model: {"name": "plate", **_write_model(carrot / "more_plate" / model, shape, size, rgba)}}
    (carrot / "more_plate" / "model_db.json").write_text(json.dumps(plate, indent=1))
    table = {}
    for k, (image, rgb) in enumerate(BACKGROUNDS.items()):
        for sub in ("imgs", "textures"):
            (carrot / "more_table" / sub).mkdir(parents=True, exist_ok=True)
        ramp = np.linspace(0.7, 1.0, 480)[:, None, None] * np.array(rgb[::-1])[None, None, :]  # BGR, a gradient
        cv2.imwrite(str(carrot / "more_table" / "imgs" / image), np.broadcast_to(ramp, (480, 640, 3)).astype(np.uint8))
        cv2.imwrite(str(carrot / "more_table" / "textures" / f"tex_{k}.png"), np.full((64, 64, 3), rgb[::-1], np.uint8))
        table[image] = {"texture": f"tex_{k}.png", "mix": 0.5}
    (carrot / "more_table" / "model_db.json").write_text(json.dumps(table, indent=1))
    _stage(data / "tasks" / "bridge_v2_real2sim_dataset" / "stages" / "bridge_table_1_v1.glb")
    robot = data / "robots" / "widowx" / "wx250s.urdf"
    robot.parent.mkdir(parents=True, exist_ok=True)
    robot.write_text(stand_in_widowx())
    return data


if __name__ == "__main__":  # python -m tests.services.env.backends.put_on_plate_assets DIR
    import sys

    print(build(sys.argv[1]))

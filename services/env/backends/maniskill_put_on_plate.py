"""``PutOnPlateInScene25Main-v3``: rlfleet's own implementation of the task of RLinf's ManiSkill setup (RLinf's
headline OpenVLA table), registered with ManiSkill's registry when the maniskill backend imports ManiSkill. It is
built on mani-skill 3.0.1's Bridge digital-twin classes (``BaseBridgeEnv``: sim at 500 Hz / control at 5 Hz,
lighting, robot placement; the real2sim-tuned ``WidowX250SBridgeDatasetFlatTable`` robot with its
``3rd_view_camera``, 640x480, and its ``arm_pd_ee_target_delta_pose_align2_gripper_pd_joint_pos`` controller:
7 actions = xyz delta, roll/pitch/yaw delta, gripper) and reads RLinf's assets in RLinf's layout
(services.env.backends.put_on_plate_assets).

- Scene: the Bridge table (``bridge_table_1_v1.glb`` of ManiSkill's ``bridge_v2_real2sim`` set); every object of
  ``more_carrot/model_db.json`` and the first plate of ``more_plate/model_db.json`` are built in each sub-scene;
  an episode uses one object and the plate, the others wait away from the table.
- Episodes: an episode id picks (object, plate, background image, object/plate positions, object yaw) in RLinf's
  order: object = id // (P * O * X * Q), plate = id // (O * X * Q) % P, background = id // (X * Q) % O,
  positions = id // Q % X, yaw = id % Q, with X = 784 position pairs (two distinct points of a 6x6 grid of
  15 cm around (-0.16, 0) at least 7 cm apart, object first) and Q = 4 object yaws (0, 45, 90, 135 degrees).
  ``obj_set``: ``train`` (objects 0-15, backgrounds 0-15), ``test`` (objects 16-24, backgrounds 16-20) or ``all``,
  as RLinf splits its 25 objects and 21 backgrounds; an asset set of another size splits at min(16, n - 1).
  A reset draws the id from the episode's seed (``reset(seed=s)`` repeats it); ``options={"episode_id": ids}``
  chooses it (``total_num_trials`` ids).
- Observations (``rgb+segmentation``, as RLinf runs it): the camera's render with everything but the robot and
  the objects replaced by the episode's background image (greenscreen); also ``state``.
- Instruction: ``put <object name> on <plate name>`` from the databases' ``name`` entries.
- Success (RLinf's rule): the object's centre lies within the plate's half bounding-box size + 1 cm in xy, above
  the plate by at most their half heights + 5 cm, and touches the plate (contact force > 0.03 N).
- Reward: ``dense`` is RLinf's step reward (``use_rel_reward``): the change of 0.1 * grasped once + 0.1 * grasped
  5 steps in a row once + 1.0 * (success and grasped once); ``normalized_dense`` divides it by 1.2; ``sparse`` is
  success.
"""

from __future__ import annotations

import cv2
import numpy as np
import sapien
import torch
from mani_skill.envs.tasks.digital_twins.base_env import BaseDigitalTwinEnv
from mani_skill.envs.tasks.digital_twins.bridge_dataset_eval.base_env import (
    BRIDGE_DATASET_ASSET_PATH,
    BaseBridgeEnv,
    WidowX250SBridgeDatasetFlatTable,
)
from mani_skill.utils import sapien_utils
from mani_skill.utils.geometry import rotation_conversions
from mani_skill.utils.registration import register_env
from mani_skill.utils.structs.pose import Pose
from sapien.physx import PhysxMaterial

from services.env.backends import put_on_plate_assets as assets

TASK_ID = "PutOnPlateInScene25Main-v3"
CAMERA = "3rd_view_camera"
TRAIN_CUT = 16  # RLinf trains on the first 16 objects and backgrounds
# RLinf's measured WidowX start (flat-table Bridge setup)
INIT_QPOS = np.array([-0.01840777, 0.0398835, 0.22242722, -0.00460194, 1.36524296, 0.00153398, 0.037, 0.037])
ROBOT_POSE = sapien.Pose([0.147, 0.028, 0.870], q=[0, 0, 0, 1])


def split(n: int, obj_set: str) -> tuple[int, int]:
    """(offset, count) of an obj_set among n models or backgrounds."""
    if obj_set == "all":
        return 0, n
    cut = min(TRAIN_CUT, max(n - 1, 1))
    if obj_set == "train":
        return 0, cut
    if obj_set == "test":
        return (cut, n - cut) if cut < n else (0, n)
    raise ValueError(f"{TASK_ID}: obj_set must be train, test or all, got {obj_set!r}")


def pose_configs(obj_z: float = 0.90, plate_z: float = 0.90) -> tuple[np.ndarray, np.ndarray]:
    """[X, 2, 3] (object, plate) start positions and [Q, 2, 4] (object, plate) start quaternions (wxyz)."""
    steps = np.linspace(0.0, 1.0, 6)
    grid = np.array([[a, b] for a in steps for b in steps]) * 2 - 1
    xy = grid * 0.075 + np.array([-0.16, 0.0])
    pairs = [(i, j) for i in range(len(xy)) for j in range(len(xy)) if i != j and np.linalg.norm(xy[j] - xy[i]) > 0.070]
    xyz = np.array([[[*xy[i], obj_z], [*xy[j], plate_z]] for i, j in pairs])
    yaws = (0.0, np.pi / 4, np.pi / 2, 3 * np.pi / 4)
    quat = np.array([[[np.cos(y / 2), 0, 0, np.sin(y / 2)], [1.0, 0, 0, 0]] for y in yaws])
    return xyz, quat


@register_env(TASK_ID, max_episode_steps=80, asset_download_ids=["bridge_v2_real2sim"])
class PutOnPlateInScene25MainV3(BaseBridgeEnv):
    SUPPORTED_OBS_MODES = ["rgb+segmentation", "state", "none"]
    SUPPORTED_REWARD_MODES = ["dense", "normalized_dense", "sparse", "none"]
    obj_static_friction = 1.0
    obj_dynamic_friction = 1.0
    rgb_overlay_mode = "none"  # the base class's one-image greenscreen is off: this task overlays one per episode

    def __init__(self, *args, obj_set: str = "train", robot_uids=WidowX250SBridgeDatasetFlatTable, **kwargs):
        self.obj_set = obj_set
        self.model_db_obj = assets.load_db("more_carrot")
        plates = assets.load_db("more_plate")
        first = next(iter(plates))
        self.model_db_plate = {first: plates[first]}  # RLinf uses the first plate only
        self.obj_names, self.plate_names = list(self.model_db_obj), list(self.model_db_plate)
        tables = assets.load_db("more_table")
        folder = assets.carrot_dir() / "more_table" / "imgs"
        self._backgrounds = []
        for name in tables:
            image = cv2.imread(str(folder / name))
            if image is None:
                raise FileNotFoundError(f"{TASK_ID}: cannot read the background image {folder / name}")
            self._backgrounds.append(cv2.cvtColor(image, cv2.COLOR_BGR2RGB))
        self.obj_offset, self.obj_count = split(len(self.obj_names), obj_set)
        self.bg_offset, self.bg_count = split(len(self._backgrounds), obj_set)
        self.xyz_configs, self.quat_configs = pose_configs()
        self.consecutive_grasp = None
        self.episode_stats = None
        self.rgb_overlay_paths = None
        BaseDigitalTwinEnv.__init__(self, *args, robot_uids=robot_uids, **kwargs)

    # --- episodes -------------------------------------------------------------------------------------------
    @property
    def total_num_trials(self) -> int:
        return self.obj_count * len(self.plate_names) * self.bg_count * len(self.xyz_configs) * len(self.quat_configs)

    def decompose(self, episode_id: torch.Tensor) -> dict[str, torch.Tensor]:
        n_plate, n_bg = len(self.plate_names), self.bg_count
        n_pos, n_quat = len(self.xyz_configs), len(self.quat_configs)
        e = episode_id.long() % self.total_num_trials
        return {
            "obj": e // (n_plate * n_bg * n_pos * n_quat) + self.obj_offset,
            "plate": (e // (n_bg * n_pos * n_quat)) % n_plate,
            "bg": (e // (n_pos * n_quat)) % n_bg + self.bg_offset,
            "pos": (e // n_quat) % n_pos,
            "quat": e % n_quat,
        }

    # --- scene ----------------------------------------------------------------------------------------------
    def _build_model(self, folder, entry: dict, name: str, pose: sapien.Pose):
        scale = float(self._episode_rng.choice(entry.get("scale", [1.0]))) if entry.get("scale") else 1.0
        material = PhysxMaterial(
            static_friction=self.obj_static_friction, dynamic_friction=self.obj_dynamic_friction, restitution=0.0
        )
        builder = self.scene.create_actor_builder()
        builder.add_multiple_convex_collisions_from_file(
            filename=str(folder / "collision.obj"),
            scale=[scale] * 3,
            material=material,
            density=entry.get("density", 1000),
        )
        builder.add_visual_from_file(filename=str(assets.visual_file(folder)), scale=[scale] * 3)
        builder.initial_pose = pose
        size = (np.array(entry["bbox"]["max"]) - np.array(entry["bbox"]["min"])) * scale
        return builder.build(name=name), torch.tensor(size, dtype=torch.float32)

    @staticmethod
    def _parking(kind: int, k: int) -> list[float]:
        return [1.0 + kind, 0.3 * k, 1.0]

    def _load_scene(self, options: dict):
        for i in range(self.num_envs):
            sapien_utils.set_articulation_render_material(self.agent.robot._objs[i], specular=0.9, roughness=0.3)
        builder = self.scene.create_actor_builder()
        stage = str(BRIDGE_DATASET_ASSET_PATH / "stages/bridge_table_1_v1.glb")
        stage_pose = sapien.Pose(q=[0.707, 0.707, 0, 0])  # the scan is y-up
        builder.add_nonconvex_collision_from_file(stage, pose=stage_pose)
        builder.add_visual_from_file(stage, pose=stage_pose)
        builder.initial_pose = sapien.Pose([2.0634, 2.8313, 0.0])
        builder.build_static(name="arena")
        root = assets.carrot_dir()
        self.objs_obj, self.objs_plate, obj_sizes, plate_sizes = [], [], [], []
        for k, name in enumerate(self.obj_names):
            actor, size = self._build_model(
                root / "more_carrot" / name, self.model_db_obj[name], name, sapien.Pose(self._parking(0, k))
            )
            self.objs_obj.append(actor)
            obj_sizes.append(size)
        for k, name in enumerate(self.plate_names):
            actor, size = self._build_model(
                root / "more_plate" / name, self.model_db_plate[name], name, sapien.Pose(self._parking(1, k))
            )
            self.objs_plate.append(actor)
            plate_sizes.append(size)
        self.obj_sizes = torch.stack(obj_sizes).to(self.device)
        self.plate_sizes = torch.stack(plate_sizes).to(self.device)

    def _after_reconfigure(self, options: dict):
        super()._after_reconfigure(options)
        ids = [link.per_scene_id for link in self.agent.robot.get_links()]
        ids += [a.per_scene_id for a in self.objs_obj + self.objs_plate]
        self._keep_ids = torch.unique(torch.cat([i.reshape(-1).to(self.device) for i in ids]))
        sensor = self._sensor_configs.get(CAMERA) if hasattr(self, "_sensor_configs") else None
        if sensor is not None and not hasattr(self, "_background_stack"):
            self._background_stack = torch.from_numpy(
                np.stack(
                    [
                        cv2.resize(b, (sensor.width, sensor.height), interpolation=cv2.INTER_AREA)
                        for b in self._backgrounds
                    ]
                )
            )

    def _initialize_episode(self, env_idx: torch.Tensor, options: dict):
        with torch.device(self.device):
            b, n = len(env_idx), self.num_envs
            if self.episode_stats is None:
                self.episode_ids = torch.zeros(n, dtype=torch.long)
                self.sel = {k: torch.zeros(n, dtype=torch.long) for k in ("obj", "plate", "bg", "pos", "quat")}
                self.obj_extent, self.plate_extent = torch.zeros(n, 3), torch.zeros(n, 3)
                self.consecutive_grasp = torch.zeros(n, dtype=torch.int32)
                self.prev_staged = torch.zeros(n)
                self.episode_stats = {
                    k: torch.zeros(n, dtype=torch.bool)
                    for k in ("is_src_obj_grasped", "consecutive_grasp", "src_on_target")
                }
            if options.get("episode_id") is not None:
                eid = torch.as_tensor(options["episode_id"], dtype=torch.long).reshape(-1)
                eid = eid.expand(b) if eid.numel() == 1 else eid
            else:
                eid = torch.as_tensor(
                    self._batched_episode_rng[env_idx.cpu().numpy()].randint(0, self.total_num_trials), dtype=torch.long
                ).reshape(b)
            self.episode_ids[env_idx] = eid % self.total_num_trials
            for key, value in self.decompose(eid).items():
                self.sel[key][env_idx] = value
            xyz = torch.as_tensor(self.xyz_configs, dtype=torch.float32)[self.sel["pos"][env_idx]]  # [b, 2, 3]
            quat = torch.as_tensor(self.quat_configs, dtype=torch.float32)[self.sel["quat"][env_idx]]  # [b, 2, 4]
            for kind, (actors, key) in enumerate(((self.objs_obj, "obj"), (self.objs_plate, "plate"))):
                for k, actor in enumerate(actors):
                    chosen = (self.sel[key][env_idx] == k)[:, None]
                    p = torch.where(chosen, xyz[:, kind], torch.tensor(self._parking(kind, k)).expand(b, 3))
                    q = torch.where(chosen, quat[:, kind], torch.tensor([1.0, 0, 0, 0]).expand(b, 4))
                    actor.set_pose(Pose.create_from_pq(p=p, q=q))
            # bounding-box extents in the world frame at the start orientation (RLinf's rule)
            for extent, sizes, kind, key in (
                (self.obj_extent, self.obj_sizes, 0, "obj"),
                (self.plate_extent, self.plate_sizes, 1, "plate"),
            ):
                rot = rotation_conversions.quaternion_to_matrix(quat[:, kind])
                extent[env_idx] = (rot.abs() @ sizes[self.sel[key][env_idx]][..., None])[..., 0]
            self.agent.robot.set_pose(ROBOT_POSE)
            self.agent.reset(init_qpos=INIT_QPOS)
            self.consecutive_grasp[env_idx] = 0
            self.prev_staged[env_idx] = 0
            for v in self.episode_stats.values():
                v[env_idx] = False

    # --- task signals ---------------------------------------------------------------------------------------
    def _per_env(self, actors, ids: torch.Tensor, fn) -> torch.Tensor:
        """fn(actor) -> [num_envs, ...] evaluated only for the actors some env uses; row i from actor ids[i]."""
        out = None
        for k in torch.unique(ids).tolist():
            value = fn(actors[k])
            if out is None:
                out = torch.zeros_like(value)
            mask = ids == k
            out[mask] = value[mask]
        return out

    def evaluate(self):
        obj_ids, plate_ids = self.sel["obj"], self.sel["plate"]
        obj_p = self._per_env(self.objs_obj, obj_ids, lambda a: a.pose.p)
        plate_p = self._per_env(self.objs_plate, plate_ids, lambda a: a.pose.p)
        grasped = self._per_env(self.objs_obj, obj_ids, lambda a: self.agent.is_grasping(a))
        self.consecutive_grasp = torch.where(
            grasped, self.consecutive_grasp + 1, torch.zeros_like(self.consecutive_grasp)
        )
        contact = torch.zeros(self.num_envs, device=self.device)
        for k in torch.unique(obj_ids).tolist():
            for m in torch.unique(plate_ids).tolist():
                force = torch.linalg.norm(
                    self.scene.get_pairwise_contact_forces(self.objs_obj[k], self.objs_plate[m]), dim=1
                )
                mask = (obj_ids == k) & (plate_ids == m)
                contact[mask] = force[mask]
        offset = obj_p - plate_p
        plate_half, obj_half = self.plate_extent / 2, self.obj_extent / 2
        xy_flag = torch.linalg.norm(offset[:, :2], dim=1) <= plate_half.max(dim=1).values + 0.01
        z_flag = (offset[:, 2] > 0) & (offset[:, 2] - plate_half[:, 2] - obj_half[:, 2] <= 0.05)
        on_plate = xy_flag & z_flag & (contact > 0.03)
        stats = self.episode_stats
        stats["src_on_target"] = on_plate
        stats["is_src_obj_grasped"] = stats["is_src_obj_grasped"] | grasped
        stats["consecutive_grasp"] = stats["consecutive_grasp"] | (self.consecutive_grasp >= 5)
        return dict(**{k: v.clone() for k, v in stats.items()}, success=on_plate)

    def compute_dense_reward(self, obs, action, info):
        staged = (
            0.1 * info["is_src_obj_grasped"].float()
            + 0.1 * info["consecutive_grasp"].float()
            + 1.0 * (info["success"] & info["is_src_obj_grasped"]).float()
        )
        reward = staged - self.prev_staged
        self.prev_staged = staged
        return reward

    def compute_normalized_dense_reward(self, obs, action, info):
        return self.compute_dense_reward(obs, action, info) / 1.2

    def get_language_instruction(self, **kwargs) -> list[str]:
        return [
            f"put {self.model_db_obj[self.obj_names[o]]['name']} on {self.model_db_plate[self.plate_names[p]]['name']}"
            for o, p in zip(self.sel["obj"].tolist(), self.sel["plate"].tolist())
        ]

    # --- observations: the episode's background image behind the robot and the objects -------------------
    def _get_obs_sensor_data(self, apply_texture_transforms: bool = True):
        obs = super()._get_obs_sensor_data(apply_texture_transforms)
        cam = obs.get(CAMERA)
        if cam is None or "rgb" not in cam or "segmentation" not in cam:
            return obs
        rgb, seg = cam["rgb"], cam["segmentation"][..., 0]
        keep = torch.isin(seg, self._keep_ids.to(seg.device))[..., None]
        background = self._background_stack.to(rgb.device)[self.sel["bg"].to(rgb.device)]
        cam["rgb"] = torch.where(keep, rgb, background.to(rgb.dtype))
        return obs

"""MuJoCo Franka Panda pick-cube environments (state and vision variants) and a scripted expert.

Gymnasium ids (registered by importing ``services.env.envs``; ``max_episode_steps=50``):
``PandaPickCube-v0`` -> :class:`PandaPickCubeEnv`, ``PandaPickCubeVision-v0`` -> :class:`PandaPickCubeVisionEnv`.

Scene: the Franka Panda MJCF + meshes shipped offline inside ``gymnasium-robotics``
(``envs/assets/kitchen_franka/franka_assets``, included by absolute path at load time, nothing copied),
patched with ``mujoco.MjSpec``: ``gravcomp=1`` on all robot bodies, a pinch/TCP site 1.5 cm above the
fingertips, collisions only for link7, the hand and one box pad per finger (never robot-robot), faster
and firmer finger servos, lighter arm joint damping (+ armature), a fixed third-person and a hand-mounted
wrist camera. A 5 cm / 0.1 kg red cube spawns uniformly in x in [0.40, 0.60], y in [-0.15, 0.15] (m,
robot base at the origin) on the floor.

Action (Box(-1, 1, (4,), float32)); values outside [-1, 1] are clipped, NaN counts as 0:
    a[0:3]  TCP xyz delta, ``action_scale`` (4 cm) per unit, relative to the *measured* TCP position,
            target clipped to the workspace box x [0.25, 0.75], y [-0.35, 0.35], z [0.02, 0.45].
    a[3]    gripper, continuous position command: -1 = fully open (8 cm), +1 = fully closed,
            opening target = 0.08 m * (1 - a[3]) / 2. Fingers reach a 5 cm cube within one control step.
Control at 10 Hz: one damped-least-squares IK step (lambda 0.05; TCP pointing down, fingers closing along
world y; null-space pull to an IK-solved home pose above the workspace) written to the joint position
servos, then ``n_substeps`` physics steps (default 10 x 10 ms, implicitfast integrator, pyramidal cones,
condim 3) in a single ``mj_step(..., nstep=n_substeps)`` call.

State observation (Box float32 (13,)):
    TCP pos (3), TCP linear vel (3), gripper opening in m (1), cube pos (3), cube - TCP (3).
Vision observation (Dict): ``third_person`` and ``wrist`` uint8 (image_size, image_size, 3) RGB, and
``state`` float32 (7,) = TCP pos, TCP vel, gripper opening.
Reward (``reward_type="dense"``, the default): 0.3 * exp(-20 |tcp - cube|) + 0.7 * clip(lift / target_lift, 0, 1),
lift = cube z - 0.025 (its rest height), target_lift 0.10 m. ``reward_type="sparse"``: 1 on every step that
succeeds, else 0 (what GRPO recipes that score episodes by success use). ``info["success"]``: lift >= target_lift
and |tcp - cube| <= 0.05.
``terminated`` is always False (the TimeLimit wrapper truncates at 50 steps).
``reset(seed=s)`` is deterministic; ``reset(options={"cube_xy": (x, y)})`` places the cube explicitly.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
from xml.sax.saxutils import quoteattr

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym  # noqa: E402
import mujoco  # noqa: E402
import numpy as np  # noqa: E402
from gymnasium import spaces  # noqa: E402

__all__ = [
    "PandaPickCubeEnv",
    "PandaPickCubeVisionEnv",
    "scripted_expert_action",
    "franka_assets_dir",
    "build_model",
    "TASK_DESCRIPTION",
]

TASK_DESCRIPTION = "pick up the red cube and lift it"

CUBE_HALF = 0.025
CUBE_MASS = 0.1
FINGER_MAX = 0.04  # per-finger slide range (m); opening = q1 + q2 in [0, 0.08]
TCP_Z_IN_LINK7 = 0.245  # ~1.5 cm above the fingertips (fingertips at ~0.26 in the link7 frame)

_ROBOT_COLLIDE = ("link7_col", "hand_col")

# Observation bounds (generous; obs are clipped to them): positions +-4 m, velocities +-10 m/s,
# gripper opening [-0.01, 0.1] m.
_OBS_HIGH = np.array([4.0] * 3 + [10.0] * 3 + [0.1] + [4.0] * 6, dtype=np.float32)
_OBS_LOW = -_OBS_HIGH
_OBS_LOW[6] = -0.01


def _clip1(v: float) -> float:
    """clip to [-1, 1]; NaN -> 0."""
    if v > 1.0:
        return 1.0
    if v < -1.0:
        return -1.0
    return v if v == v else 0.0


def franka_assets_dir() -> str:
    """Directory of the Panda MJCF fragments inside the installed gymnasium-robotics (not imported)."""
    spec = importlib.util.find_spec("gymnasium_robotics")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("gymnasium-robotics is required (it ships the Franka Panda meshes)")
    root = list(spec.submodule_search_locations)[0]
    path = os.path.join(root, "envs", "assets", "kitchen_franka", "franka_assets")
    if not os.path.isfile(os.path.join(path, "chain.xml")):
        raise RuntimeError(f"Franka assets not found at {path}")
    return path


def _lookat_xyaxes(pos, target, up=(0.0, 0.0, 1.0)):
    pos, target, up = (np.asarray(v, dtype=float) for v in (pos, target, up))
    fwd = target - pos
    fwd /= np.linalg.norm(fwd)
    x = np.cross(fwd, up)
    x /= np.linalg.norm(x)
    y = np.cross(x, fwd)
    return np.concatenate([x, y])


def _scene_xml(fa: str, timestep: float, offscreen: int) -> str:
    def inc(name: str) -> str:
        return f"<include file={quoteattr(os.path.join(fa, name))}/>"

    return f"""
<mujoco model="panda_pick_cube">
  {inc("assets.xml")}
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{timestep}" integrator="implicitfast" cone="pyramidal" iterations="30" ls_iterations="10"/>
  <visual>
    <global offwidth="{offscreen}" offheight="{offscreen}"/>
    <quality shadowsize="0"/>
    <headlight ambient="0.4 0.4 0.4" diffuse="0.6 0.6 0.6" specular="0.1 0.1 0.1"/>
  </visual>
  <asset>
    <texture name="floor_tex" type="2d" builtin="checker" rgb1=".35 .38 .42" rgb2=".25 .28 .32"
             width="256" height="256"/>
    <material name="floor_mat" texture="floor_tex" texrepeat="10 10" reflectance="0"/>
  </asset>
  <worldbody>
    <light name="top" directional="true" pos="0 0 3" dir="0 0 -1" diffuse=".5 .5 .5" castshadow="false"/>
    <geom name="floor" type="plane" size="2 2 1" material="floor_mat" contype="1" conaffinity="1"/>
    <body name="robot_base" pos="0 0 0">
      {inc("chain.xml")}
    </body>
    <body name="cube" pos="0.5 0 {CUBE_HALF}">
      <freejoint name="cube_joint"/>
      <geom name="cube" type="box" size="{CUBE_HALF} {CUBE_HALF} {CUBE_HALF}" mass="{CUBE_MASS}"
            rgba="0.85 0.1 0.1 1" friction="1.0 0.005 0.0001" contype="1" conaffinity="1"/>
    </body>
  </worldbody>
  {inc("actuator.xml")}
</mujoco>
"""


def build_model(
    timestep: float = 0.002,
    with_cameras: bool = False,
    with_visuals: bool = True,
    fine_meshes: bool = False,
    image_size: int = 64,
    finger_kp: float = 800.0,
    finger_damping: float = 80.0,
    finger_armature: float = 0.05,
    finger_force: float = 60.0,
    arm_kp_scale: float = 1.0,
    arm_damping: tuple = (40.0, 4.0),
    arm_armature: float = 0.1,
    pad_half_width: float = 0.014,
    pad_friction: float = 1.5,
    pad_solref: float = 0.01,
    condim: int = 3,
) -> mujoco.MjModel:
    """Compile the pick-cube scene. Returns an ``MjModel``."""
    fa = franka_assets_dir()
    spec = mujoco.MjSpec.from_string(_scene_xml(fa, timestep, max(640, int(image_size))))
    # Mesh paths: make them absolute ("<fa>/meshes/{collision,visual}/<name>.stl") whatever the
    # include-relative resolution of this MuJoCo version produced.
    spec.geom("cube").condim = condim
    spec.meshdir = ""
    for mesh in spec.meshes:
        parts = mesh.file.replace("\\", "/").split("/")
        mesh.file = os.path.join(fa, "meshes", parts[-2], parts[-1])

    robot_bodies = []
    stack = [spec.body("panda0_link0")]
    while stack:
        b = stack.pop()
        robot_bodies.append(b)
        stack.extend(b.bodies)
    for b in robot_bodies:
        b.gravcomp = 1.0
        for g in b.geoms:
            if g.contype == 0 and g.conaffinity == 0:
                continue  # visual geom
            if g.meshname in _ROBOT_COLLIDE:
                g.contype, g.conaffinity = 2, 1  # touches world/cube, never the robot itself
            else:
                g.contype, g.conaffinity = 0, 0

    # Finger pads: one box per finger on the inner face near the tip (finger frame: slide axis y).
    for name, sign in (("panda0_leftfinger", 1.0), ("panda0_rightfinger", -1.0)):
        fb = spec.body(name)
        fb.add_geom(
            name=name + "_pad",
            type=mujoco.mjtGeom.mjGEOM_BOX,
            size=[pad_half_width, 0.004, 0.0125],
            pos=[0.0, sign * 0.005, 0.080],
            contype=2,
            conaffinity=1,
            condim=condim,
            friction=[pad_friction, 0.01, 0.0002],
            solref=[pad_solref, 1.0],
            solimp=[0.95, 0.99, 0.001, 0.5, 2.0],
            margin=0.0,
            group=3,
            rgba=[0.2, 0.2, 0.2, 1.0],
            mass=0.0,
        )

    link7 = spec.body("panda0_link7")
    for site in link7.sites:
        site.group = 5  # hide the kitchen model's end_effector marker from cameras
    link7.add_site(
        name="tcp",
        pos=[0.0, 0.0, TCP_Z_IN_LINK7],
        quat=[0.92388, 0.0, 0.0, -0.382683],
        size=[0.008, 0.0, 0.0],
        rgba=[0.0, 1.0, 0.0, 0.0],
        group=4,
    )

    # Arm servos and joints.
    for i in range(7):
        j = spec.joint(f"robot:panda0_joint{i + 1}")
        j.damping = [arm_damping[0] if i < 4 else arm_damping[1], 0.0, 0.0]
        j.armature = arm_armature
        a = spec.actuator(f"panda0_joint{i + 1}")
        a.gainprm[0] *= arm_kp_scale
        a.biasprm[1] *= arm_kp_scale
    # Gripper: fast, firm position servos (the kitchen model's fingers have armature 5 and are slow).
    for jn, an in (
        ("robot:panda0_finger_joint1", "r_gripper_finger_joint"),
        ("robot:panda0_finger_joint2", "l_gripper_finger_joint"),
    ):
        j = spec.joint(jn)
        j.damping = [finger_damping, 0.0, 0.0]
        j.armature = finger_armature
        a = spec.actuator(an)
        a.gainprm[0] = finger_kp
        a.biasprm[1] = -finger_kp
        a.forcerange = [-finger_force, finger_force]

    if with_cameras:
        tp_pos = (1.0, -0.45, 0.95)
        spec.worldbody.add_camera(
            name="third_person", pos=list(tp_pos), xyaxes=list(_lookat_xyaxes(tp_pos, (0.45, 0.0, 0.2))), fovy=45.0
        )
        # Wrist camera on the hand, beside the fingers (perpendicular to the closing axis), looking
        # along the gripper towards the fingertips.
        c, s = math.cos(-math.pi / 4), math.sin(-math.pi / 4)
        side = np.array([c, s, 0.0])  # hand x axis in the link7 frame (closing axis is hand y)
        cam_pos = 0.075 * side + np.array([0.0, 0.0, 0.12])
        look = np.array([0.0, 0.0, 0.30])
        xy = _lookat_xyaxes(cam_pos, look, up=side)
        link7.add_camera(name="wrist", pos=list(cam_pos), xyaxes=list(xy), fovy=75.0)

    # Freeze the inertias computed from the (mass-carrying) collision meshes, then drop geoms that
    # neither collide nor render (disabled link meshes, finger capsules; visual meshes too when the
    # model is never rendered): fewer geoms = cheaper kinematics/collision per physics step.
    full = spec.compile()
    for b in robot_bodies:
        i = full.body(b.name).id
        b.explicitinertial = True
        b.mass = float(full.body_mass[i])
        b.ipos = full.body_ipos[i].copy()
        b.iquat = full.body_iquat[i].copy()
        b.inertia = full.body_inertia[i].copy()
    used = set()
    for b in robot_bodies:
        for g in list(b.geoms):
            collides = g.contype != 0 or g.conaffinity != 0
            if not collides and not fine_meshes and g.meshname.endswith("_viz") and g.meshname != "finger_viz":
                # ~150k-triangle visual meshes cost ~30 ms per software-GL frame; the 200-triangle
                # collision meshes look the same at policy resolutions.
                g.meshname = g.meshname[:-4] + "_col"
            if collides or (with_visuals and g.group < 3):
                if g.type == mujoco.mjtGeom.mjGEOM_MESH:
                    used.add(g.meshname)
            else:
                spec.delete(g)
    for mesh in list(spec.meshes):
        if mesh.name not in used:
            spec.delete(mesh)
    return spec.compile()


@functools.lru_cache(maxsize=16)
def _compile_cached(items: tuple) -> mujoco.MjModel:
    return build_model(**dict(items))


def _cached_model(**kwargs) -> mujoco.MjModel:
    """A private copy of a per-process cached compiled model (compiling takes ~0.5 s; copying ~ms)."""
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    return copy.copy(_compile_cached(items))


def _make_renderer(model: mujoco.MjModel, height: int, width: int) -> mujoco.Renderer:
    """``mujoco.Renderer``; headless-safe when mujoco was imported before MUJOCO_GL was set.

    mujoco picks its GL backend at import time; with MUJOCO_GL unset that is GLFW, which needs a display.
    In that case (no DISPLAY) switch mujoco's classic renderer to EGL, else OSMesa, before creating it.
    """
    if not os.environ.get("DISPLAY"):
        try:
            from mujoco.rendering.classic import gl_context as _glc
        except ImportError:  # pragma: no cover - other mujoco layouts
            _glc = None
        ctx = getattr(_glc, "GLContext", None)
        if _glc is not None and (ctx is None or "glfw" in getattr(ctx, "__module__", "glfw")):
            for backend in ("egl", "osmesa"):
                try:
                    _glc.GLContext = importlib.import_module(f"mujoco.{backend}").GLContext
                    break
                except Exception:  # noqa: BLE001 - try the next backend
                    continue
    return mujoco.Renderer(model, height, width)


class PandaPickCubeEnv(gym.Env):
    """Franka Panda picks up a cube; state observations. See the module docstring for the spaces.

    Args:
        render_mode: None or "rgb_array" (``render()`` returns the third-person view, ``render_size`` px).
        control_dt: seconds per env step (0.1 = 10 Hz).
        n_substeps: physics steps per env step (timestep = control_dt / n_substeps). 10 is the cheapest
            setting that kept grasps as tolerant as 20-50 substeps in our checks; 8 or fewer is not.
        action_scale: metres of TCP motion per unit action.
        target_lift: lift (m) for full lift reward and for success.
        reward_type: "dense" (reaching + lifting terms) or "sparse" (1 on each successful step, else 0).
        cube_x_range, cube_y_range: cube spawn region (m).
        ik_damping, null_gain: damped-least-squares lambda and null-space pull gain.
        **model_kwargs: physics knobs forwarded to :func:`build_model` (finger_kp, finger_damping, ...).
    """

    #: reset and step touch only MjData and numpy (no renderer: ``render()`` makes one, and VecEnv never calls
    #: it): the env server may step it from any thread, one call at a time (services.env.backends.base)
    steps_on_any_thread = True

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        render_mode: str | None = None,
        control_dt: float = 0.1,
        n_substeps: int = 10,
        action_scale: float = 0.04,
        target_lift: float = 0.10,
        reward_type: str = "dense",
        cube_x_range: tuple = (0.40, 0.60),
        cube_y_range: tuple = (-0.15, 0.15),
        render_size: int = 256,
        ik_damping: float = 0.05,
        null_gain: float = 0.2,
        _with_cameras: bool = False,
        _image_size: int = 64,
        **model_kwargs,
    ):
        super().__init__()
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"unsupported render_mode {render_mode!r}")
        self.render_mode = render_mode
        self.task_description = TASK_DESCRIPTION
        self.n_substeps = max(1, int(n_substeps))
        self.control_dt = float(control_dt)
        physics_dt = self.control_dt / self.n_substeps
        self.action_scale = float(action_scale)
        self.target_lift = float(target_lift)
        if reward_type not in ("dense", "sparse"):
            raise ValueError(f"reward_type {reward_type!r} is not one of 'dense', 'sparse'")
        self.sparse_reward = reward_type == "sparse"
        self.cube_x_range = tuple(map(float, cube_x_range))
        self.cube_y_range = tuple(map(float, cube_y_range))
        self.render_size = int(render_size)
        self._lam2 = float(ik_damping) ** 2
        self._null_gain = float(null_gain)

        cams = _with_cameras or render_mode == "rgb_array"
        self.model = _cached_model(
            timestep=physics_dt,
            with_cameras=cams,
            with_visuals=cams,
            image_size=max(_image_size, self.render_size),
            **model_kwargs,
        )
        self.data = mujoco.MjData(self.model)
        m, d = self.model, self.data

        self._tcp_id = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, "tcp")
        cube_jnt = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, "cube_joint")
        self._cube_qadr = int(m.jnt_qposadr[cube_jnt])
        arm_q = [
            int(m.jnt_qposadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, f"robot:panda0_joint{i}")])
            for i in range(1, 8)
        ]
        fin_q = [
            int(m.jnt_qposadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, f"robot:panda0_finger_joint{i}")])
            for i in (1, 2)
        ]
        assert arm_q == list(range(7)) and fin_q == [7, 8] and self._cube_qadr == 9, "unexpected layout"
        self._jnt_lo = m.jnt_range[:7, 0].copy()
        self._jnt_hi = m.jnt_range[:7, 1].copy()

        # Persistent views into MjData (valid for the lifetime of self.data).
        self._q_arm = d.qpos[:7]
        self._qd_arm = d.qvel[:7]
        self._q_fing = d.qpos[7:9]
        self._ctrl_arm = d.ctrl[:7]
        self._ctrl_fing = d.ctrl[7:9]
        self._tcp = d.site_xpos[self._tcp_id]
        self._tcp_mat = d.site_xmat[self._tcp_id]
        self._cube_pos = d.qpos[self._cube_qadr : self._cube_qadr + 3]
        # Scratch buffers.
        self._jacp = np.zeros((3, m.nv))
        self._jacr = np.zeros((3, m.nv))
        self._J = np.zeros((6, 7))
        self._err = np.zeros(6)
        self._eye6 = np.eye(6) * self._lam2
        self._JT = self._J.T  # view
        self._A = np.zeros((6, 6))
        self._z = np.zeros(7)
        self._v6 = np.zeros(6)
        self._y = np.zeros(6)
        self._q_tmp = np.zeros(7)
        self._tcp_vel = np.zeros(3)

        self.ws_lo = np.array([0.25, -0.35, 0.02])
        self.ws_hi = np.array([0.75, 0.35, 0.45])
        self._ws = (tuple(self.ws_lo.tolist()), tuple(self.ws_hi.tolist()))
        self.home_tcp = np.array([0.5, 0.0, 0.25])
        self.q_home = self._solve_home(self.home_tcp)

        self.action_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        self.observation_space = self._make_observation_space()
        self._renderer = None

    # ------------------------------------------------------------------ spaces / obs
    def _make_observation_space(self):
        return spaces.Box(_OBS_LOW, _OBS_HIGH, dtype=np.float32)

    def _state_obs(self) -> np.ndarray:
        obs = np.empty(13, np.float32)
        obs[0:3] = self._tcp
        obs[3:6] = self._tcp_vel
        obs[6] = self._q_fing[0] + self._q_fing[1]
        obs[7:10] = self._cube_pos
        obs[10:13] = obs[7:10] - obs[0:3]
        np.clip(obs, _OBS_LOW, _OBS_HIGH, out=obs)  # only bites if the cube is flung away
        return obs

    def _get_obs(self):
        return self._state_obs()

    # ------------------------------------------------------------------ kinematics / IK
    def _refresh(self):
        """Positions, Jacobian and TCP velocity for the current qpos/qvel (after mj_step)."""
        m, d = self.model, self.data
        mujoco.mj_kinematics(m, d)
        mujoco.mj_comPos(m, d)
        mujoco.mj_jacSite(m, d, self._jacp, self._jacr, self._tcp_id)
        J = self._J
        J[:3] = self._jacp[:, :7]
        J[3:] = self._jacr[:, :7]
        np.dot(J[:3], self._qd_arm, out=self._tcp_vel)

    def _ik_step(self, tx: float, ty: float, tz: float, q_null, out) -> None:
        """One damped-least-squares IK step towards TCP target (tx, ty, tz), gripper pointing down.

        out = q + z + J^T (J J^T + lam^2 I)^-1 (e - J z),  z = null_gain * (q_null - q)
        (6-d task: position error + orientation error; no allocations: preallocated buffers).
        """
        px, py, pz = self._tcp.tolist()
        x = self._tcp_mat.tolist()  # row-major 3x3; columns are the site axes
        # orientation error 0.5 * sum_i col_i(R) x col_i(R_des), R_des columns (1,0,0), (0,-1,0),
        # (0,0,-1): TCP z axis down, fingers closing along world y.
        self._err[:] = (tx - px, ty - py, tz - pz, 0.5 * (x[7] - x[5]), 0.5 * (x[6] + x[2]), -0.5 * (x[3] + x[1]))
        e = self._err
        J, A, z, v6, y = self._J, self._A, self._z, self._v6, self._y
        q = self._q_arm
        np.subtract(q_null, q, out=z)
        z *= self._null_gain
        np.dot(J, z, out=v6)
        np.subtract(e, v6, out=v6)
        np.dot(J, J.T, out=A)
        A += self._eye6
        mujoco.mju_cholFactor(A, 0.0)
        mujoco.mju_cholSolve(y, A, v6)
        np.dot(self._JT, y, out=out)
        out += q
        out += z

    def _solve_home(self, target) -> np.ndarray:
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        q_ref = np.array([0.0, 0.0, 0.0, -2.0, 0.0, 0.4, 0.0])  # rough "elbow up, hand down" guess
        q_ref = np.clip(q_ref, self._jnt_lo, self._jnt_hi)
        d.qpos[:7] = q_ref
        for _ in range(300):
            self._refresh()
            self._ik_step(float(target[0]), float(target[1]), float(target[2]), q_ref, self._q_tmp)
            d.qpos[:7] = np.clip(self._q_tmp, self._jnt_lo + 0.05, self._jnt_hi - 0.05)
        self._refresh()
        err = np.linalg.norm(self._tcp - target)
        if err > 2e-3 or np.abs(self._err[3:]).max() > 1e-2:
            raise RuntimeError(f"home IK did not converge (err {err:.4f})")
        return d.qpos[:7].copy()

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        d.qpos[:7] = self.q_home
        d.qpos[7:9] = FINGER_MAX
        d.ctrl[:7] = self.q_home
        d.ctrl[7:9] = FINGER_MAX
        cx = self.np_random.uniform(*self.cube_x_range)
        cy = self.np_random.uniform(*self.cube_y_range)
        if options and "cube_xy" in options:
            cx, cy = map(float, options["cube_xy"])
        a = self._cube_qadr
        d.qpos[a : a + 7] = (cx, cy, CUBE_HALF, 1.0, 0.0, 0.0, 0.0)
        mujoco.mj_forward(m, d)
        self._refresh()
        info = {"success": False, "task_description": self.task_description}
        return self._get_obs(), info

    def step(self, action):
        a0, a1, a2, a3 = np.asarray(action).reshape(4).tolist()
        s = self.action_scale
        (lx, ly, lz), (hx, hy, hz) = self._ws
        px, py, pz = self._tcp.tolist()
        tx = min(max(px + s * _clip1(a0), lx), hx)
        ty = min(max(py + s * _clip1(a1), ly), hy)
        tz = min(max(pz + s * _clip1(a2), lz), hz)
        g = _clip1(a3)

        self._ik_step(tx, ty, tz, self.q_home, self._ctrl_arm)
        self._ctrl_fing[:] = FINGER_MAX * 0.5 * (1.0 - g)
        mujoco.mj_step(self.model, self.data, nstep=self.n_substeps)
        self._refresh()

        obs = self._get_obs()
        px, py, pz = self._tcp.tolist()
        cx, cy, cz = self._cube_pos.tolist()
        dist = math.sqrt((cx - px) ** 2 + (cy - py) ** 2 + (cz - pz) ** 2)
        lift = cz - CUBE_HALF
        success = lift >= self.target_lift and dist <= 0.05
        if self.sparse_reward:
            reward = float(success)
        else:
            reward = 0.3 * math.exp(-20.0 * dist) + 0.7 * min(max(lift / self.target_lift, 0.0), 1.0)
        return obs, reward, False, False, {"success": success}

    def expert_action(self) -> np.ndarray:
        """The scripted expert's action for the current state (privileged: also for the vision env)."""
        return scripted_expert_action(self._state_obs())

    # ------------------------------------------------------------------ rendering
    def _get_renderer(self, size: int):
        if self._renderer is None:
            self._renderer = _make_renderer(self.model, size, size)
        return self._renderer

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        r = self._get_renderer(self.render_size)
        r.update_scene(self.data, camera="third_person")
        return r.render()

    def close(self):
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        super().close()


class PandaPickCubeVisionEnv(PandaPickCubeEnv):
    """Same task; observations = {third_person, wrist: uint8 (image_size, image_size, 3); state: float32 (7,)}.

    ``image_size`` (default 64) sets both cameras; other kwargs as :class:`PandaPickCubeEnv`. Rendering uses
    the light (200-300 triangle) collision meshes for the arm (``fine_meshes=True`` for the original
    visual meshes, ~30x slower on software GL) and no shadows.
    """

    steps_on_any_thread = False  # its observations are rendered (a GL context bound to the thread that made it)

    def __init__(self, image_size: int = 64, render_mode: str | None = None, **kwargs):
        self.image_size = int(image_size)
        kwargs.setdefault("render_size", self.image_size)
        super().__init__(render_mode=render_mode, _with_cameras=True, _image_size=self.image_size, **kwargs)
        self._img_renderer = _make_renderer(self.model, self.image_size, self.image_size)
        self._cam_tp = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, "third_person")
        self._cam_wrist = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, "wrist")

    def _make_observation_space(self):
        s = self.image_size
        img = spaces.Box(0, 255, (s, s, 3), np.uint8)
        return spaces.Dict(
            {
                "third_person": img,
                "wrist": spaces.Box(0, 255, (s, s, 3), np.uint8),
                "state": spaces.Box(_OBS_LOW[:7], _OBS_HIGH[:7], dtype=np.float32),
            }
        )

    def _get_obs(self):
        r = self._img_renderer
        s = self.image_size
        tp = np.empty((s, s, 3), np.uint8)
        wr = np.empty((s, s, 3), np.uint8)
        r.update_scene(self.data, camera=self._cam_tp)
        r.render(out=tp)
        r.update_scene(self.data, camera=self._cam_wrist)
        r.render(out=wr)
        state = np.empty(7, np.float32)
        state[0:3] = self._tcp
        state[3:6] = self._tcp_vel
        state[6] = self._q_fing[0] + self._q_fing[1]
        np.clip(state, _OBS_LOW[:7], _OBS_HIGH[:7], out=state)
        return {"third_person": tp, "wrist": wr, "state": state}

    def close(self):
        r = getattr(self, "_img_renderer", None)
        if r is not None:
            r.close()
            self._img_renderer = None
        super().close()


def scripted_expert_action(obs) -> np.ndarray:
    """Stateless scripted expert on the 13-d state observation (tcp, gripper opening, cube position).

    Phases, chosen from ``obs`` alone each step: (1) gripper open, move over the cube at 6 cm above it;
    (2) within 1.2 cm in xy, descend to the cube centre; (3) close; (4) once the fingers rest on the cube
    (opening in (0.03, 0.058) m, cube within 2 cm), keep closing and lift. A missed grasp (fingers fully
    closed) falls back to (1). Succeeds on 100/100 seeded episodes, first success after ~10 steps.
    """
    o = np.asarray(obs, dtype=np.float64)
    tcp, opening, cube = o[0:3], o[6], o[7:10]
    rel = cube - tcp
    xy_err = math.hypot(rel[0], rel[1])
    act = np.zeros(4, np.float32)
    gain = 1.0 / 0.04  # full action = 4 cm
    held = opening < 0.058 and abs(rel[2]) < 0.03 and xy_err < 0.02 and opening > 0.03
    if held:
        act[0:2] = np.clip(rel[0:2] * gain, -1, 1)
        act[2] = 1.0
        act[3] = 1.0
    elif xy_err > 0.012:
        hover_z = cube[2] + 0.06
        act[0:2] = np.clip(rel[0:2] * gain, -1, 1)
        act[2] = np.clip((hover_z - tcp[2]) * gain, -1, 1) if xy_err > 0.03 else 0.0
        act[3] = -1.0
    elif rel[2] < -0.008:
        act[0:2] = np.clip(rel[0:2] * gain, -1, 1)
        act[2] = np.clip(rel[2] * gain, -1, 1)
        act[3] = -1.0
    else:
        act[0:2] = np.clip(rel[0:2] * gain, -1, 1)
        act[3] = 1.0
    return act

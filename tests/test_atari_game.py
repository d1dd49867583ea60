"""ppo_atari.py's Game, Worker and Model, checked against the emulator itself.

The Game's pictures are compared with frames read from a second, independent `ale_py.ALEInterface`
that starts from the Game's own emulator state (cloned at each `env.reset`) and is driven by the
protocol the Game documents (no-ops, FIRE then 2, 4-frame repeat, max of the last two frames, 84x84
area resize, 4-frame stack restarted as zeros and the first picture, NOOP + FIRE + 2 after a life loss). Everything the Game sends to the
emulator is recorded by wrapping its `env.step` and `env.reset`.
"""
import math
from multiprocessing import shared_memory

import ale_py
import cv2
import gymnasium as gym
import numpy as np
import pytest
import torch

import ppo_atari as pa

BREAKOUT = "BreakoutNoFrameskip-v4"


# ----- helpers ------------------------------------------------------------------------------------


class Recorder:
    """Wraps a Game's `env.step` and `env.reset`: records every emulator frame the Game asks for
    (action, raw reward, terminated, truncated) and every reset (with the emulator state right after
    it, RNG included, so that an independent ALE can replay from there). Optionally lets a test change
    what a frame returns (`patch(index, result) -> result`, index counting all frames)."""

    def __init__(self, game, patch=None):
        self.game = game
        self.events = []  # ("reset", state) or ("frame", action, reward, terminated, truncated)
        self.frames_seen = 0
        step, reset = game.env.step, game.env.reset

        def recorded_step(action):
            result = step(action)
            if patch is not None:
                result = patch(self.frames_seen, result)
            self.frames_seen += 1
            _, reward, terminated, truncated, _ = result
            self.events.append(("frame", int(action), float(reward), bool(terminated), bool(truncated)))
            return result

        def recorded_reset(**kwargs):
            result = reset(**kwargs)
            self.events.append(("reset", game.ale.cloneState(include_rng=True)))
            return result

        game.env.step, game.env.reset = recorded_step, recorded_reset

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int) -> list:
        return self.events[mark:]

    @staticmethod
    def actions(events) -> list:
        return [event[1] for event in events if event[0] == "frame"]

    def last_reset(self):
        """(index of the last reset event, its emulator state)."""
        index = max(i for i, event in enumerate(self.events) if event[0] == "reset")
        return index, self.events[index][1]


def shrink(previous_frame, frame):
    """The expected picture: max of the last two frames, 84x84 with area interpolation."""
    return cv2.resize(np.maximum(previous_frame, frame), (84, 84), interpolation=cv2.INTER_AREA)


def fresh_stack(picture):
    """The stack at the start of a training episode: three zero pictures, then the first picture."""
    return np.stack([np.zeros_like(picture)] * 3 + [picture])


class ReferenceALE:
    """A second emulator, independent of the Game's, started from a cloned state."""

    def __init__(self, rom: str, sticky: float):
        self.ale = ale_py.ALEInterface()
        self.ale.setLoggerMode(ale_py.LoggerMode.Error)
        self.ale.setFloat("repeat_action_probability", sticky)
        self.ale.setInt("max_num_frames_per_episode", 108_000)
        self.ale.loadROM(ale_py.roms.get_rom_path(rom))
        self.minimal_actions = self.ale.getMinimalActionSet()
        self.previous_frame = self.frame = None

    def restore(self, state):
        self.ale.restoreState(state)
        self.previous_frame = self.frame = self.ale.getScreenGrayscale()

    def act(self, action: int, frames: int) -> float:
        """`frames` frames of the agent's action `action`, stopping at game over (or truncation)."""
        reward = 0.0
        for _ in range(frames):
            reward += self.ale.act(self.minimal_actions[action])
            self.previous_frame, self.frame = self.frame, self.ale.getScreenGrayscale()
            if self.ale.game_over():  # with_truncation=True by default
                break
        return reward

    def picture(self):
        return shrink(self.previous_frame, self.frame)


def run_until(game, action, condition, max_steps=5000):
    """Step `game` with a fixed action (or a function of the step number) until `condition(result)`."""
    for t in range(max_steps):
        result = game.step(action(t) if callable(action) else action)
        if condition(result):
            return t, result
    raise AssertionError(f"condition not met within {max_steps} steps")


# ----- 1. preprocessing against the emulator -------------------------------------------------------


@pytest.mark.parametrize("env_id, sticky", [(BREAKOUT, 0.0), ("ALE/Breakout-v5", 0.25)])
def test_pictures_match_an_independent_emulator(env_id, sticky):
    # v5: sticky actions stay (0.25, replayed with the cloned RNG) but the Game must step 1 frame at a
    # time; with v5's own frameskip of 4 the frames would not match.
    game = pa.Game(env_id, seed=1)
    recorder = Recorder(game)
    reference = ReferenceALE("breakout", sticky)

    def replay_reset():
        index, state = recorder.last_reset()
        noops = Recorder.actions(recorder.events[index:])
        k = noops.index(1)  # no-ops until the first FIRE
        reference.restore(state)
        for _ in range(k):
            reference.act(0, 1)
        reference.act(1, 4)
        reference.act(2, 4)
        return fresh_stack(reference.picture())

    obs = game.reset()
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
    np.testing.assert_array_equal(obs, replay_reset())

    life_losses = games_over = shifts = 0
    newest = set()
    for t in range(150):
        action = (t // 3) % 4  # every Breakout action in turn (NOOP, FIRE, RIGHT, LEFT), 3 steps each
        lives = reference.ale.lives()
        reward = reference.act(action, 4)
        expected_final = np.concatenate([obs[1:], reference.picture()[None]])
        previous_obs = obs
        obs, clipped, terminated, truncated, info = game.step(action)
        assert clipped == np.sign(reward)
        assert not truncated
        if reference.ale.game_over():
            games_over += 1
            assert terminated and "episode" in info
            np.testing.assert_array_equal(info["final_obs"], expected_final)
            np.testing.assert_array_equal(obs, replay_reset())
        elif 0 < reference.ale.lives() < lives:
            life_losses += 1
            assert terminated and "episode" not in info
            np.testing.assert_array_equal(info["final_obs"], expected_final)
            reference.act(0, 4)  # EpisodicLifeEnv's NOOP step, then FireResetEnv's FIRE and 2
            reference.act(1, 4)
            reference.act(2, 4)
            np.testing.assert_array_equal(obs, fresh_stack(reference.picture()))
        else:
            shifts += 1
            assert not terminated and info == {}
            np.testing.assert_array_equal(obs, expected_final)
            np.testing.assert_array_equal(obs[:-1], previous_obs[1:])  # the stack moves by one picture
            newest.add(obs[-1].tobytes())
    assert life_losses >= 2 and games_over >= 1 and shifts >= 100  # every branch was taken...
    assert len(newest) > 50  # ...and the pictures really change
    game.close()


# ----- 2. no-op starts -----------------------------------------------------------------------------


def noop_counts(seed: int, resets: int) -> list:
    """The number of no-ops at each of `resets` real resets of one Game, checking the actions sent."""
    game = pa.Game(BREAKOUT, seed)
    recorder = Recorder(game)
    counts = []
    for _ in range(resets):
        mark = recorder.mark()
        game.reset()
        events = recorder.since(mark)
        assert events[0][0] == "reset" and all(e[0] == "frame" for e in events[1:])
        actions = Recorder.actions(events)
        k = len(actions) - 8
        assert actions == [0] * k + [1] * 4 + [2] * 4  # no-ops, then FIRE and 2 (Breakout)
        counts.append(k)
    game.close()
    return counts


def test_noop_starts_take_1_to_30_noops_drawn_per_reset():
    counts = [k for seed in range(10) for k in noop_counts(seed, 5)]  # 5 real resets per Game
    assert all(1 <= k <= 30 for k in counts), counts
    assert min(counts) <= 5 and max(counts) >= 26 and len(set(counts)) >= 10, counts
    assert noop_counts(0, 5) == counts[:5]  # the same seed draws the same numbers


def test_noop_max_1_gives_exactly_one_noop():
    game = pa.Game(BREAKOUT, 3, noop_max=1)
    recorder = Recorder(game)
    for _ in range(3):
        mark = recorder.mark()
        game.reset()
        assert Recorder.actions(recorder.since(mark)) == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    game.close()


# ----- 3. FIRE ---------------------------------------------------------------------------------------


def test_breakout_presses_fire_then_2_after_reset_and_after_a_life_loss():
    game = pa.Game(BREAKOUT, 1)
    assert game.needs_fire
    recorder = Recorder(game)
    mark = recorder.mark()
    game.reset()
    actions = Recorder.actions(recorder.since(mark))
    assert actions[-8:] == [1] * 4 + [2] * 4 and set(actions[:-8]) == {0}
    life_losses = 0
    for _ in range(200):
        mark = recorder.mark()
        _, _, terminated, _, info = game.step(3)  # LEFT, always: the ball is soon missed
        actions = Recorder.actions(recorder.since(mark))
        if terminated:
            assert "episode" not in info
            assert actions == [3] * 4 + [0] * 4 + [1] * 4 + [2] * 4
            life_losses += 1
            if life_losses == 2:
                break
        else:
            assert actions == [3] * 4
    assert life_losses == 2
    game.close()


def test_games_without_fire_never_get_fire():
    # Pong has FIRE at index 1; Freeway and Ms. Pac-Man do not (index 1 is UP there).
    assert pa.Game("PongNoFrameskip-v4", 0).needs_fire
    assert not pa.Game("FreewayNoFrameskip-v4", 0).needs_fire
    game = pa.Game("MsPacmanNoFrameskip-v4", 0)  # has lives: a life loss is seen too
    assert not game.needs_fire
    assert game.env.unwrapped.get_action_meanings()[1] == "UP"
    recorder = Recorder(game)
    mark = recorder.mark()
    game.reset()
    assert set(Recorder.actions(recorder.since(mark))) == {0}  # no-ops only
    life_losses = 0
    for _ in range(400):
        mark = recorder.mark()
        _, _, terminated, _, info = game.step(3)  # LEFT
        actions = Recorder.actions(recorder.since(mark))
        if terminated and "episode" not in info:
            assert actions == [3] * 4 + [0] * 4  # the NOOP step after a life loss, and no FIRE
            life_losses += 1
            break
        assert actions == [3] * 4
    assert life_losses == 1
    game.close()


# ----- 4., 5. life loss and game over ------------------------------------------------------------------


def test_life_loss_ends_the_training_episode_but_not_the_game():
    game = pa.Game(BREAKOUT, 2)
    recorder = Recorder(game)
    obs = game.reset()
    assert game.ale.lives() == 5
    for _ in range(200):
        lives, frame_number = game.ale.lives(), game.ale.getEpisodeFrameNumber()
        previous_obs = obs
        resets = sum(e[0] == "reset" for e in recorder.events)
        obs, reward, terminated, truncated, info = game.step(0)
        if terminated:
            break
    else:
        raise AssertionError("no life lost in 200 NOOP steps")
    assert terminated and not truncated
    assert "final_obs" in info and "episode" not in info
    np.testing.assert_array_equal(info["final_obs"][:-1], previous_obs[1:])
    assert not np.array_equal(info["final_obs"][-1], previous_obs[-1])
    # the game goes on: one life fewer, no reset, 4 + 12 frames further (step, NOOP, FIRE, 2)
    assert game.ale.lives() == lives - 1
    assert sum(e[0] == "reset" for e in recorder.events) == resets
    assert game.ale.getEpisodeFrameNumber() == frame_number + 16
    # a new training episode: the stack restarts from zeros and one picture
    assert not obs[:3].any() and obs[3].any()
    assert reward in (-1.0, 0.0, 1.0)
    # and the next step shifts again
    next_obs, _, terminated, _, _ = game.step(0)
    assert not terminated
    np.testing.assert_array_equal(next_obs[:-1], obs[1:])
    game.close()


def test_game_over_reports_the_episode_and_starts_a_new_game():
    game = pa.Game(BREAKOUT, 4)
    recorder = Recorder(game)
    game.reset()
    life_ends = 0
    for t in range(1000):
        mark = recorder.mark()
        obs, reward, terminated, truncated, info = game.step(0)
        if "episode" in info:
            break
        life_ends += terminated
    else:
        raise AssertionError("no game over in 1000 NOOP steps")
    assert life_ends == 4  # 5 lives: 4 life losses, then game over
    assert terminated and not truncated and "final_obs" in info
    episode = info["episode"]
    assert set(episode) == {"return", "length"}
    assert isinstance(episode["return"], float) and isinstance(episode["length"], int)
    assert episode["length"] == t + 1
    # the game over happened at the last frame before the reset (the repeat stopped there)...
    events = recorder.since(mark)
    reset_at = next(i for i, e in enumerate(events) if e[0] == "reset")
    frames = events[:reset_at]
    assert 1 <= len(frames) <= 4
    assert [e[3] for e in frames] == [False] * (len(frames) - 1) + [True]
    # ...and the observation is the first of a new game, with all its lives, after no-ops and FIRE
    assert game.ale.lives() == 5
    assert not obs[:3].any() and obs[3].any()  # a fresh stack: zeros and the first picture
    assert game.ale.getEpisodeFrameNumber() == len(events) - reset_at - 1  # frames since the reset
    assert not np.array_equal(info["final_obs"][-1], obs[-1])
    game.close()


# ----- 6. the repeat stops inside the 4 frames ---------------------------------------------------------


def end_at(frame_index, terminated=False, truncated=False):
    def patch(index, result):
        if index == frame_index:
            obs, reward, term, trunc, info = result
            return obs, reward, term or terminated, trunc or truncated, info
        return result
    return patch


def test_repeat_stops_when_the_game_ends_inside_the_4_frames():
    game = pa.Game(BREAKOUT, 5)
    holder = {}
    recorder = Recorder(game, patch=lambda i, r: end_at(holder.get("at", -1), terminated=True)(i, r))
    game.reset()
    for _ in range(3):
        game.step(2)
    holder["at"] = recorder.frames_seen + 1  # the 2nd frame of the next step
    mark = recorder.mark()
    _, _, terminated, truncated, info = game.step(2)
    events = recorder.since(mark)
    reset_at = next(i for i, e in enumerate(events) if e[0] == "reset")
    assert Recorder.actions(events[:reset_at]) == [2, 2]  # 2 frames, not 4
    assert terminated and not truncated
    assert "episode" in info and info["episode"]["length"] == 4
    game.close()


def truncating_game(limit=200):
    """Pong (no lives, long points) with ALE's frame limit lowered to `limit`: the first reset reloads the
    ROM, which applies the setting."""
    game = pa.Game("PongNoFrameskip-v4", 0)
    game.ale.setInt("max_num_frames_per_episode", limit)
    return game


def test_repeat_stops_at_the_time_limit_inside_the_4_frames():
    game = truncating_game(202)  # reset takes k no-ops + 8 FIRE frames: the limit falls anywhere in a step
    recorder = Recorder(game)
    game.reset()
    for t in range(100):
        before = game.ale.getEpisodeFrameNumber()
        mark = recorder.mark()
        _, _, terminated, _, info = game.step(0)
        if "episode" in info:
            break
    events = recorder.since(mark)
    reset_at = next(i for i, e in enumerate(events) if e[0] == "reset")
    frames = events[:reset_at]
    assert len(frames) == 202 - before  # stopped at the limit, not after 4 frames
    assert [e[4] for e in frames] == [False] * (len(frames) - 1) + [True]  # the emulator truncated
    assert not terminated  # a time limit is not a death
    assert "final_obs" in info and info["episode"]["length"] == t + 1
    game.close()


def test_time_limit_is_reported_as_truncation():
    game = truncating_game(200)
    game.reset()
    _, (_, _, terminated, truncated, info) = run_until(game, 0, lambda result: "episode" in result[4], 100)
    assert not terminated
    assert truncated  # else the trainer would neither cut GAE nor bootstrap from final_obs
    game.close()


def test_truncation_inside_the_repeat_is_reported():
    game = pa.Game(BREAKOUT, 6)
    holder = {}
    recorder = Recorder(game, patch=lambda i, r: end_at(holder.get("at", -1), truncated=True)(i, r))
    game.reset()
    game.step(2)
    holder["at"] = recorder.frames_seen + 2  # the 3rd frame of the next step
    mark = recorder.mark()
    _, _, terminated, truncated, info = game.step(2)
    events = recorder.since(mark)
    reset_at = next(i for i, e in enumerate(events) if e[0] == "reset")
    assert Recorder.actions(events[:reset_at]) == [2, 2, 2]  # 3 frames, not 4
    assert "episode" in info and not terminated
    assert truncated  # a time limit is reported as truncation, not as the end of the game
    game.close()


# ----- 7. rewards ------------------------------------------------------------------------------------------


def check_rewards(game, recorder, actions, after_reset=lambda: None, games=1):
    """Play `games` whole games (the 2nd and later after the Game's own reset); check each training reward
    against the raw frames of the agent's repeat, and each episode's return against every raw reward
    since the emulator's reset. Returns the raw rewards and the training rewards."""
    game.reset()
    after_reset()
    start, t = recorder.last_reset()[0], 0
    raw_all, clipped = [], []
    for _ in range(5000 * games):
        mark = recorder.mark()
        _, reward, _, _, info = game.step(actions(t))
        t += 1
        clipped.append(reward)
        frames = [e for e in recorder.since(mark) if e[0] == "frame"]
        agent_frames = frames[:4]  # the repeat comes first (NOOP/FIRE/no-ops after it)
        ended = [i for i, e in enumerate(agent_frames) if e[3] or e[4]]
        if ended:
            agent_frames = agent_frames[:ended[0] + 1]
        assert reward == np.sign(sum(e[2] for e in agent_frames))
        if "episode" in info:
            end = recorder.last_reset()[0]
            raw = [e[2] for e in recorder.events[start:end] if e[0] == "frame"]
            assert info["episode"]["return"] == pytest.approx(sum(raw))
            assert info["episode"]["length"] == t
            raw_all += raw
            games -= 1
            if games == 0:
                assert set(clipped) <= {-1.0, 0.0, 1.0}
                return raw_all, clipped
            start, t = end, 0
    raise AssertionError("the games did not end")


def test_rewards_are_clipped_but_the_return_is_the_raw_score():
    game = pa.Game("SpaceInvadersNoFrameskip-v4", 0)  # 5 to 30 points an alien
    recorder = Recorder(game)
    rng = np.random.default_rng(0)
    raw, clipped = check_rewards(game, recorder, lambda t: int(rng.integers(6)), games=2)
    assert max(raw) > 1 and sum(raw) > sum(clipped) > 0
    game.close()


def test_negative_and_mixed_raw_rewards_are_clipped_to_their_sign():
    armed = {"on": False}  # after the reset's no-ops: the test below covers those

    def patch(index, result):
        obs, reward, terminated, truncated, info = result
        if armed["on"]:
            reward += (-2.5 if index % 7 == 0 else 0.0) + (7.0 if index % 11 == 0 else 0.0)
        return obs, reward, terminated, truncated, info

    game = pa.Game(BREAKOUT, 8)
    recorder = Recorder(game, patch=patch)
    raw, clipped = check_rewards(game, recorder, lambda t: 0, after_reset=lambda: armed.update(on=True))
    assert {-1.0, 0.0, 1.0} <= set(clipped)
    assert min(raw) < -1 and max(raw) > 1
    game.close()


def test_points_scored_during_the_noops_count_in_the_return():
    def patch(index, result):  # 5 points at the first no-op frame of the game
        obs, reward, terminated, truncated, info = result
        return obs, reward + (5.0 if index == 0 else 0.0), terminated, truncated, info

    game = pa.Game(BREAKOUT, 9)
    recorder = Recorder(game, patch=patch)
    check_rewards(game, recorder, lambda t: 0)
    game.close()


# ----- 8. Worker: in process and in a child -------------------------------------------------------------


def test_worker_in_a_child_process_matches_in_process():
    seeds, shape = [11, 12], (2, 4, 84, 84)
    local_view = np.zeros(shape, dtype=np.uint8)
    local = pa.InProcessWorker(0, BREAKOUT, seeds[0], local_view, [])
    memory = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)))
    child = None
    try:
        child_view = np.ndarray(shape, dtype=np.uint8, buffer=memory.buf)
        child = pa.GuardedWorker(1, BREAKOUT, seeds[0], child_view, inherited_trainer_ends=[])
        assert child.process.is_alive()
        np.testing.assert_array_equal(child_view, local_view)
        assert local_view.any()
        rng = np.random.default_rng(0)
        finals = episodes = 0
        for _ in range(250):
            actions = rng.integers(4, size=2)
            before = child_view.copy()
            local.send_step(actions)
            child.send_step(actions)
            mine, theirs = local.receive(), child.receive()
            for a, b in zip(mine[:3], theirs[:3]):  # rewards, terminated, truncated
                np.testing.assert_array_equal(a, b)
                assert a.dtype == b.dtype and a.shape == (2,)
            assert mine[3].keys() == theirs[3].keys()
            for i in mine[3]:
                assert theirs[3][i].dtype == np.uint8 and theirs[3][i].shape == (4, 84, 84)
                np.testing.assert_array_equal(theirs[3][i], mine[3][i])
                np.testing.assert_array_equal(theirs[3][i][:-1], before[i][1:])  # the ended episode's last stack
                assert mine[2][i] or mine[1][i]
            assert mine[4] == theirs[4]
            np.testing.assert_array_equal(child_view, local_view)
            finals += len(mine[3])
            episodes += len(mine[4])
        assert finals >= 4 and episodes >= 1  # final observations and episodes did cross the pipe
    finally:
        local.close()
        if child is not None:
            child.close()
            assert not child.process.is_alive()
        child_view = None
        memory.close()
        memory.unlink()


# ----- 9. Model --------------------------------------------------------------------------------------------


# ----- 9. the ale-vector backend against the Game ------------------------------------------------------


def play_both(env_id: str, steps: int, seed: int = 4, stop_at_life_loss: bool = False):
    """Step a Game and a one-game VectorGames with the same random actions, no-ops off (sticky actions
    are off in *NoFrameskip-v4 ids), and check that they agree on everything the trainer reads.
    Returns the counts of training episodes and games that ended, and, with `stop_at_life_loss`, the
    last results of both at the first life loss."""
    game = pa.Game(env_id, seed, noop_max=0)
    vector = pa.VectorGames(env_id, [seed], noop_max=0)
    obs_out = vector.obs_array
    obs = game.reset()
    np.testing.assert_array_equal(obs_out[0], obs)
    rng = np.random.default_rng(seed)
    dones = games = 0
    for t in range(steps):
        action = int(rng.integers(game.env.action_space.n))
        previous = obs_out[0].copy()
        obs, reward, terminated, truncated, info = game.step(action)
        rewards, terminated_v, truncated_v, final_obs, episodes = vector.step(np.array([action]))
        assert (reward, terminated, truncated) == (rewards[0], terminated_v[0], truncated_v[0]), f"step {t}"
        life_lost = terminated and "episode" not in info
        if life_lost and stop_at_life_loss:
            vector.close()
            return previous, (obs, info), (obs_out[0].copy(), 0 in episodes, episodes)
        assert not life_lost, f"step {t}: a life loss, which this comparison cannot follow"
        np.testing.assert_array_equal(obs_out[0], obs, err_msg=f"step {t}")
        assert (0 in episodes) == (terminated or truncated)  # the vector env restarted its stack
        assert ("episode" in info) == (0 in episodes)
        if "episode" in info:
            assert episodes[0] == info["episode"]
            # The named difference at the end of a game: the 3 older pictures agree, the newest is the
            # vector env's own (built from other frames); it shows the same moment, a few pixels apart.
            np.testing.assert_array_equal(final_obs[0][:3], info["final_obs"][:3])
            assert np.mean(final_obs[0][3] != info["final_obs"][3]) < 0.05
            games += 1
        dones += terminated or truncated
    vector.close()
    game.close()
    return dones, games


def test_vector_env_equals_the_game_over_a_whole_game():
    # Freeway: no lives and no FIRE, so nothing of the two named differences applies; a game lasts
    # 2 min 16 s, 2,048 agent steps, and ends by game over.
    dones, games = play_both("FreewayNoFrameskip-v4", 2_100)
    assert games == 1 and dones == 1


def test_vector_env_equals_the_game_at_the_time_limit():
    # The same game under a 402-frame limit: truncation falls in the middle of a 4-frame repeat.
    spec = gym.spec("FreewayNoFrameskip-v4")
    gym.register("TestFreewayShort-v4", entry_point=spec.entry_point,
                 kwargs={**spec.kwargs, "max_num_frames_per_episode": 402})
    try:
        dones, games = play_both("TestFreewayShort-v4", 250)
    finally:
        gym.registry.pop("TestFreewayShort-v4")
    assert games == 2 and dones == 2


def test_after_a_life_loss_the_vector_env_plays_on_where_the_game_restarts():
    # The named difference (VectorGames' docstring): both report the life loss as a termination and
    # agree up to it; then the Game takes a NOOP step and restarts its stack, the vector env does not.
    previous, (game_obs, game_info), (vector_obs, restarted, episodes) = play_both(
        "MsPacmanNoFrameskip-v4", 2_000, stop_at_life_loss=True)
    np.testing.assert_array_equal(game_info["final_obs"], vector_obs)  # the same picture of the loss
    np.testing.assert_array_equal(vector_obs[:-1], previous[1:])  # the vector env's stack goes on...
    assert not restarted and not episodes  # ...and the game is not over
    assert not game_obs[:3].any()  # the Game's stack restarts: zeros and the picture after the NOOP step


def test_the_vector_env_presses_fire_for_one_frame_at_a_reset():
    # The other named difference: the Game presses FIRE then 2 for 4 frames each (FireResetEnv).
    vector = pa.VectorGames(BREAKOUT, [5], noop_max=0)
    obs_out = vector.obs_array
    reference = ReferenceALE("breakout", 0.0)
    reference.ale.setInt("random_seed", 5)
    reference.ale.loadROM(ale_py.roms.get_rom_path("breakout"))
    reference.restore(reference.ale.cloneState(include_rng=True))
    reference.act(1, 1)
    np.testing.assert_array_equal(obs_out[0], fresh_stack(shrink(reference.frame, reference.frame)))
    game = pa.Game(BREAKOUT, 5, noop_max=0)
    recorder = Recorder(game)
    game.reset()
    assert Recorder.actions(recorder.events) == [1] * 4 + [2] * 4
    vector.close()
    game.close()


def test_model_shapes_and_uint8_input_scaled_inside():
    torch.manual_seed(0)
    model = pa.Model(6)
    obs = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    logits, value = model(obs)
    assert logits.shape == (3, 6) and value.shape == (3,)
    assert logits.dtype == value.dtype == torch.float32
    # the 1/255 is inside the model: uint8 input gives what body(x / 255) gives, not body(x)
    hidden = model.body(obs.float() / 255.0)
    torch.testing.assert_close(logits, model.actor(hidden))
    torch.testing.assert_close(value, model.critic(hidden).squeeze(-1))
    unscaled = model.body(obs.float())
    assert not torch.allclose(model.critic(unscaled).squeeze(-1), value)
    actions, log_prob, act_value = model.act(obs)
    assert actions.shape == log_prob.shape == act_value.shape == (3,)


def test_model_orthogonal_init_with_the_right_gains_and_zero_biases():
    model = pa.Model(4)
    layers = [m for m in model.body if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert len(layers) == 4
    expected = [(layer, math.sqrt(2)) for layer in layers] + [(model.actor, 0.01), (model.critic, 1.0)]
    for layer, gain in expected:
        w = layer.weight.detach().double().reshape(layer.weight.shape[0], -1)
        rows, columns = w.shape
        gram = w @ w.T if rows <= columns else w.T @ w
        torch.testing.assert_close(gram, gain ** 2 * torch.eye(min(rows, columns), dtype=torch.float64),
                                   atol=1e-5 * max(gain ** 2, 1e-2), rtol=0)
        assert torch.count_nonzero(layer.bias) == 0
    shapes = [tuple(layer.weight.shape) for layer, _ in expected]
    assert shapes == [(32, 4, 8, 8), (64, 32, 4, 4), (64, 64, 3, 3), (512, 3136), (4, 512), (1, 512)]


# ----- 10. serving after a lost life, and telling game over from a lost life --------------------------


def play_without_fire(backend: str, steps: int):
    """Breakout with a policy that only ever sends NOOP: (lives lost, games over, steps played)."""
    lives_lost = games = 0
    if backend == "game":
        game = pa.Game(BREAKOUT, 3)
        game.reset()
        for t in range(steps):
            _, _, terminated, truncated, info = game.step(0)
            lives_lost += terminated and "episode" not in info
            games += "episode" in info
            if games:
                break
        game.close()
        return lives_lost, games, t + 1
    vector = pa.VectorGames(BREAKOUT, [3])
    for t in range(steps):
        result = vector.step(np.zeros(1, dtype=np.int64))
        lives_lost += bool(result.terminated[0] and 0 not in result.episodes)
        games += 0 in result.episodes
        if games:
            break
    vector.close()
    return lives_lost, games, t + 1


@pytest.mark.parametrize("backend", ["game", "ale-vector"])
def test_a_policy_that_never_presses_fire_is_served_after_every_lost_life(backend):
    # Unserved, the ball never comes back after the first lost life and the game never ends.
    lives_lost, games, steps = play_without_fire(backend, 2_000)
    assert (lives_lost, games) == (4, 1), steps  # 5 lives: 4 lost, then game over
    assert steps < 1_000  # a NOOP paddle misses each ball within a few dozen steps


def test_the_vector_env_tells_game_over_from_a_lost_life_by_the_frame_counter():
    endings = pa.VectorGames.endings
    # Game 0 plays on; game 1 loses a life; game 2's game is over, and it held more lives than a new
    # game starts with (bonus lives): its counter went back all the same; game 3 loses a life on the
    # step it earns a bonus one (its lives do not change) and plays on.
    terminated = np.array([False, True, True, True])
    frames = np.array([404, 1204, 31, 9004])
    previous = np.array([400, 1200, 52_000, 9000])
    restarted, life_lost = endings(terminated, frames, previous)
    assert restarted.tolist() == [False, False, True, False]
    assert life_lost.tolist() == [False, True, False, True]
    # A game cut by the frame limit restarts too (no termination), and a counter that stood still
    # (no frame played: cannot happen within a game) is read as a new game, never as a lost life.
    restarted, life_lost = endings(np.array([False, True]), np.array([12, 800]), np.array([108_000, 800]))
    assert restarted.tolist() == [True, True] and life_lost.tolist() == [False, False]

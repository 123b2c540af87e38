"""The RL core: rollout engines, trainers, algorithms, and the loop that drives them."""

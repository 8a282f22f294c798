"""A sample reward file for env=dataset (env.reward_fn=data/sample_rewards.py:reversed_digits).

A reward function is called as fn(prompt, completion, **row_columns) -> float: the row's other columns
(here `answer` and `id`) arrive as keyword arguments.
"""


def reversed_digits(prompt, completion, answer, **kwargs):
    """1.0 for the exact reversal, partial credit for each digit in place."""
    got, want = completion.strip(), str(answer)
    if got == want:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(got, want)) / len(want)

"""Samples of every kind the doctor's sample scan tells apart, shared by its two scans' tests.

Index: 0 a normal dialogue, 1 empty, 2 no supervised label, 3 labels shorter than the ids,
4-5 longer than a ``max_length`` of 5 (6 and 5 tokens: one truncated, one not), 6 a
supervised label masked mid-answer.
"""

SAMPLE_KINDS = [
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
    {"input_ids": [], "labels": []},
    {"input_ids": [1, 2], "labels": [-100, -100]},
    {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3]},
    {"input_ids": list(range(6)), "labels": list(range(6))},
    {"input_ids": list(range(5)), "labels": list(range(5))},
    {"input_ids": [7, 8, 9, 10, 11], "labels": [7, -100, 9, 10, 11]},
]

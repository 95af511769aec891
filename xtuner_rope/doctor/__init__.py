"""The tools users run on their data, models and runs: doctor, check, replay, convert and chat."""

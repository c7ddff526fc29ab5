"""Source text of a user's reward file, written to a temporary file by the tests."""

SOURCE = '''
import os
import time


def length_reward(data_source, response, ground_truth, extra_info, scale=1.0):
    return {"score": scale * len(response), "chars": len(response)}


def echo_category(data_source, response, ground_truth, extra_info):
    # extra columns of the row reach the scorer through extra_info
    return 100.0 if extra_info.get("category") == "chat" and extra_info["index"] == 7 else -1.0


def flaky(data_source, response, ground_truth, extra_info):
    if response.startswith("sleep"):
        time.sleep(30)
    if response.startswith("raise"):
        raise ZeroDivisionError("the scorer failed on " + response)
    if response.startswith("exit"):
        os._exit(7)
    return float(response.split()[-1])
'''


def write(tmp_path) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(SOURCE)
    return str(path)

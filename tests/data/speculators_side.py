"""Run with speculators' interpreter (/work/main/.venv-speculators/bin/python); never imports
dflash_lab. Reads a speculators offline dataset with their own training reader
(``speculators.train.data.ArrowDataset``, the cached-file path, ``on_missing="raise"``) and
writes what it yields per row to one safetensors file, for tests/data/test_speculators_data.py:

    python tests/data/speculators_side.py DATA_DIR OUT_FILE MAX_LEN

Keys ``{row}.hidden_states`` [S, (n-1) * H] (their aux layers), ``{row}.verifier_last`` [S, H],
``{row}.input_ids`` [S], ``{row}.loss_mask`` [S].
"""

import sys

from safetensors.torch import save_file
from speculators.train.data import ArrowDataset


def main() -> None:
    data_dir, out_file, max_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dataset = ArrowDataset(max_len, data_dir, on_missing="raise")
    out = {}
    for row in range(len(dataset)):
        item = dataset[row]
        out[f"{row}.hidden_states"] = item["hidden_states"].contiguous()
        out[f"{row}.verifier_last"] = item["verifier_last_hidden_states"].contiguous()
        out[f"{row}.input_ids"] = item["input_ids"].contiguous()
        out[f"{row}.loss_mask"] = item["loss_mask"].contiguous()
    save_file(out, out_file)


if __name__ == "__main__":
    main()

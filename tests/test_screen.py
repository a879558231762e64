"""What a learner's screen shows: counts as integers, numbers without numpy's type names."""
import subprocess
import sys

import numpy as np
import pandas as pd
import torch

from labkit.measure.profile import trace
from labkit.teaching.lab import whole_counts


def test_a_float_column_of_whole_numbers_shows_as_integers_and_other_columns_are_kept():
    df = pd.DataFrame({"kernels": [688.0, np.nan], "us": [2.5, 3.0], "name": ["a", "b"]})
    shown = whole_counts(df)
    assert str(shown.kernels.dtype) == "Int64" and shown.kernels.iloc[0] == 688
    assert shown.us.dtype == float and shown.name.dtype == df.name.dtype
    assert "688.0" not in repr(shown) and "688" in repr(shown)
    assert df.kernels.dtype == float, "the caller's table is not changed"
    assert str(whole_counts(pd.Series([256.0, 2.0])).dtype) == "Int64"
    assert whole_counts(pd.Series([256.0, 2.5])).dtype == float


def test_a_trace_summary_prints_counts_as_integers():
    x = torch.zeros(8)
    table = trace(lambda: [x.mul_(2) for _ in range(150)], device="cpu").summary_table()
    text = repr(table)
    assert "150.000000" not in text and " 150\n" in text, text


def test_after_lab_start_a_notebook_shows_counts_as_integers():
    script = (
        "import numpy as np, pandas as pd\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        "from labkit.teaching import lab\n"
        "lab.start('cpu')\n"
        "df = pd.DataFrame({'kernel_count': [688.0, 150.0], 'us': [2.499, 0.5]})\n"
        "data, _ = shell.display_formatter.format(df)\n"
        "print('PLAIN', data['text/plain']); print('HTML', data['text/html'])\n"
        "print('SCALAR', repr({'numel': np.float64(16.0)}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "688.0" not in out and "<td>688</td>" in out and "688" in out.split("HTML")[0], out
    assert "np.float64" not in out and "{'numel': 16.0}" in out, out


def test_after_lab_start_floats_show_no_padding_zeros_and_warnings_print_as_text():
    script = (
        "import warnings, pandas as pd\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        "from labkit.teaching import lab\n"
        "lab.start('cpu')\n"
        "df = pd.DataFrame({'share': [0.0, 0.781622], 'vs MLA': [71.111111, 1.0]})\n"
        "data, _ = shell.display_formatter.format(df)\n"
        "print('PLAIN', data['text/plain']); print('HTML', data['text/html'])\n"
        "warnings.warn('copies run synchronously here')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert ".000000" not in done.stdout and "0.781622" in done.stdout, done.stdout
    assert "<td>71.1111</td>" in done.stdout, done.stdout
    assert "warning (UserWarning): copies run synchronously here" in done.stdout
    assert "copies run synchronously" not in done.stderr, done.stderr

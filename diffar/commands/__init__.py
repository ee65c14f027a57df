"""One module per `diffar` command. Each has `register(subparsers)`, which adds the command's parser(s) and
sets `func` (what runs it); `diffar/cli.py` wires them into one parser."""

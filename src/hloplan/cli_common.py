"""What the command modules (cli.py, cli_explain.py) share."""

from __future__ import annotations

MESH_HELP = "mesh axis sizes ('8', '2x4', '16x8x8') or named axes ('data=8,model=4')"

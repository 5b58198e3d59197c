"""The synthetic world's front-camera raster as ASCII, per scene: both frames side by side (the earlier one | t = 0),
one character per pixel, under the scene's CoC; a look at what the vision tower reads (driving.render). Moved here
from `python driving.py --render`. Paper: the camera images of the VLA's prompt (the toy's stand-in for Alpamayo-R1's
multi-camera video), whose tokens the FlatRoPE draft's 1D positions step over.

run: python experiments/render_scenes.py --seed 0 --n 6 --split train
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import driving  # noqa: E402
from ops import cli  # noqa: E402

GLYPHS = (("ego", "E"), ("vehicle", "V"), ("pedestrian", "P"), ("cone", "C"), ("light_red", "R"),
          ("light_green", "G"), ("in_lane", "L"), ("object", "o"), ("stop_line", "="))


def ascii_render(frames):
    """Both frames side by side, one character per pixel, the first matching channel of GLYPHS wins."""
    glyph = lambda f, r, c: next((g for n, g in GLYPHS if frames[f, driving.CH[n], r, c] > 0), " ")  # noqa: E731
    return "\n".join("   ".join("".join(glyph(f, r, c) for c in range(frames.shape[3])) for f in range(frames.shape[0]))
                     for r in range(frames.shape[2]))


@cli.program
def main(argv=None):
    ap = argparse.ArgumentParser(description="Print scenes of the synthetic driving world as ASCII rasters.")
    ap.add_argument("--seed", type=int, default=0, help="seed of the printed scenes")
    ap.add_argument("--n", type=int, default=6, help="scenes to print")
    ap.add_argument("--split", default="train", choices=list(driving.SPLITS), help="split to draw the scenes from")
    args = cli.checked(ap, ap.parse_args(argv), counts=("n",))
    for sc in driving.make_split(args.split, args.n, args.seed):
        print(f"{sc.f.road} / {sc.f.event} / roadside {sc.f.left} {sc.f.right} | CoC: {' '.join(sc.coc)}")
        print(ascii_render(sc.frames))


if __name__ == "__main__":
    main()

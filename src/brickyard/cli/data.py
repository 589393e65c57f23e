"""``brickyard data``."""
from __future__ import annotations

import argparse
from pathlib import Path

from brickyard.errors import BrickyardError

# what `main` advises when the host's memory runs out during this command (it trains nothing: no batch size)
MEMORY_ADVICE = "try a smaller --jpeg or --max-size (pixels a side), or --limit"
LARGEST = 4096  # pixels a side of a written image: a 4096 x 4096 RGB image is 50 MB in memory

EXAMPLES = """examples:
  brickyard data fetch mnist
  brickyard data info fashion-mnist
  brickyard data export mnist digits/      # then: --set data.name=imagefolder --set data.root=digits
"""


def add(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    d = sub.add_parser("data", help="fetch or describe a data set", epilog=EXAMPLES, formatter_class=raw)
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION")
    photos = dsub.add_parser("make-photos", help="write a photo-like JPEG image folder for tests and benchmarks (docs/images-and-finetuning.md)")
    photos.add_argument("out", metavar="DIR", help="folder to write (train/, val/, test/)")
    photos.add_argument("--classes", type=int, default=10)
    photos.add_argument("--per-class", type=int, nargs=3, default=[100, 20, 20], metavar=("TRAIN", "VAL", "TEST"))
    photos.add_argument("--seed", type=int, default=0)
    photos.add_argument("--min-size", type=int, default=64)
    photos.add_argument("--max-size", type=int, default=512)
    for name, doc in (("fetch", "download and verify a data set"), ("info", "where a data set is and what it holds"),
                      ("export", "write a data set as a PNG image folder (train/, val/, test/)")):
        a = dsub.add_parser(name, help=doc)
        a.add_argument("name", help="mnist, fashion-mnist" + (", cifar10 or cifar100" if name != "export" else
                                                              ", mnist-mosaic or fashion-mnist-mosaic (a folder tagged by CSV files)"))
        if name == "export":
            a.add_argument("out", metavar="DIR", help="folder to write")
            a.add_argument("--limit", type=int, default=0, help="only the first N images of each class in each split (a mosaic set: of each split)")
            a.add_argument("--jpeg", type=int, default=0, metavar="SIZE", help="RGB JPEGs upscaled to SIZE px (a photo-sized benchmark workload)")
        a.add_argument("--root", help="folder holding the data set's files")


def run(args) -> int:
    # torch and the modules that import it load here, for this command only (cli/main.py: start-up time)
    from brickyard.data import cifar, idx
    if args.data_command is None:
        raise BrickyardError("data: say fetch or info, e.g. `brickyard data fetch mnist`.")
    if args.data_command == "make-photos":
        return _photos(args)
    if args.name in cifar.SPECS and args.data_command != "export":
        return _cifar(args, cifar, idx)
    if args.data_command == "export" and args.name.endswith("-mosaic") and args.name.removesuffix("-mosaic") in idx.SPECS:
        return _mosaic(args)
    if args.name not in idx.SPECS:
        known = list(idx.SPECS) + ([f"{n}-mosaic" for n in idx.SPECS] if args.data_command == "export" else list(cifar.SPECS))
        raise BrickyardError(f"data set {args.name!r} is not one of {', '.join(known)}"
                             f"{' (export writes the MNIST-format sets)' if args.name in cifar.SPECS else ''}.")
    if args.data_command == "export":
        if args.limit < 0 or args.jpeg < 0:
            raise BrickyardError("data export: --limit and --jpeg are 0 (all images; PNG at their own size) or more.")
        if args.jpeg > LARGEST:
            raise BrickyardError(f"data export: --jpeg {args.jpeg} is past {LARGEST} pixels a side; MNIST's 28 pixels "
                                 f"upscaled further hold nothing new.")
        from brickyard.data.export import export_idx
        counts = export_idx(args.name, Path(args.out), args.root, args.limit, args.jpeg)
        kind = f"{args.jpeg}x{args.jpeg} RGB JPEG" if args.jpeg else "PNG"
        print(f"wrote {', '.join(f'{n:,} {s}' for s, n in counts.items())} {kind} images to {args.out}")
        return 0
    if args.data_command == "fetch":
        arrays = idx.load_idx(args.name, args.root, allow_download=True)
        print(f"{args.name}: {len(arrays['train-labels-idx1-ubyte']):,} train + "
              f"{len(arrays['t10k-labels-idx1-ubyte']):,} test images verified in {idx.locate(args.name, args.root)}")
        return 0
    folder = idx.locate(args.name, args.root)
    print(f"{args.name}: classes {', '.join(idx.classes(args.name))}")
    print(f"looked up in: {', '.join(str(d) for d in idx.candidate_dirs(args.name, args.root))}")
    if folder is None:
        print("not present; `brickyard data fetch` downloads it")
        return 1
    arrays = idx.load_idx(args.name, args.root, allow_download=False)
    tr, te = arrays["train-images-idx3-ubyte"], arrays["t10k-images-idx3-ubyte"]
    print(f"found in {folder}: train {tuple(tr.shape)} uint8, test {tuple(te.shape)} uint8 (checksums verified)")
    print("default split: train 50,000 / val 10,000 / test 10,000 (data.train_on_all: true trains on 60,000)")
    return 0


def _mosaic(args) -> int:
    """``export mnist-mosaic DIR``: several labels an image, as a folder tagged by CSV files."""
    # torch loads for this command only (cli/main.py: start-up time)
    from brickyard.data.export import export_mosaic
    if args.limit < 0 or args.jpeg:
        raise BrickyardError("data export: a mosaic set takes --limit 0 (all images) or more, and no --jpeg.")
    counts = export_mosaic(args.name, Path(args.out), args.root, args.limit)
    print(f"wrote {', '.join(f'{n:,} {s}' for s, n in counts.items())} PNG images and train.csv, val.csv, test.csv "
          f"(image,tags) to {args.out}; train on it with --set data.name=imagefolder --set data.root={args.out}")
    return 0


def _cifar(args, cifar, idx) -> int:
    """``fetch`` and ``info`` of CIFAR-10/100 (the binary archives)."""
    folder = cifar.locate(args.name, args.root)
    if args.data_command == "info" and folder is None:
        print(f"{args.name}: looked up in {', '.join(str(d) for d in idx.candidate_dirs(args.name, args.root))}")
        print("not present; `brickyard data fetch` downloads it")
        return 1
    arrays = cifar.load(args.name, args.root, allow_download=args.data_command == "fetch")
    (xtr, _), (xte, _) = arrays["train"], arrays["test"]
    print(f"{args.name}: {len(xtr):,} train + {len(xte):,} test images of {len(arrays['classes'])} classes "
          f"({', '.join(arrays['classes'][:10])}{', ...' if len(arrays['classes']) > 10 else ''}) in "
          f"{cifar.locate(args.name, args.root)}; default split: the last 10% of train for validation")
    return 0


def _photos(args) -> int:
    # lazy: Pillow and numpy load for this command only (cli/main.py: start-up time)
    from brickyard.data.export import prepare_folder
    from brickyard.data.photos import make_photo_folder
    if args.classes < 2 or min(args.per_class) < 1 or not 16 <= args.min_size <= args.max_size:
        raise BrickyardError("data make-photos: --classes must be at least 2, every --per-class count at least 1, "
                             "and 16 <= --min-size <= --max-size.")
    if args.max_size > LARGEST:
        raise BrickyardError(f"data make-photos: --max-size {args.max_size} is past {LARGEST} pixels a side.")
    prepare_folder(Path(args.out), {"command": "data make-photos", "classes": args.classes, "per_class": list(args.per_class),
                                    "seed": args.seed, "min_size": args.min_size, "max_size": args.max_size})
    counts = make_photo_folder(Path(args.out), args.classes, dict(zip(("train", "val", "test"), args.per_class)),
                               args.seed, args.min_size, args.max_size)
    print(f"wrote {', '.join(f'{n:,} {s}' for s, n in counts.items())} JPEG images of {args.classes} classes to {args.out} "
          f"(seed {args.seed}); train on it with --set data.name=imagefolder --set data.root={args.out}")
    return 0

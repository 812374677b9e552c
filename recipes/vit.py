"""ViT on the shared trunk: image tokenizer (patches) -> trunk -> classification head.

    python recipes/vit.py                              # Fashion-MNIST (built if missing), preset for the device
    python recipes/vit.py --preset tiny                # CPU smoke run
    python recipes/vit.py --preset B/16 --data shards/imagenet --set epochs=90
    python recipes/vit.py --preset B/16 --data ... --set "trunk_overrides={'bias': False}"   # PaLM-style, 6% faster
    accelerate launch --num_processes 8 recipes/vit.py --preset B/16 --data ...
    python recipes/vit.py --preset B/16 --data ... --set init=timm/vit-b16     # fine-tune a converted timm ViT
    python recipes/vit.py --preset B/16 --data ... --set init=timm/vit-b16 image_size=1024 resize=1024 \
        "trunk_overrides.attention={'pattern': {'kind': 'any', 'of': [{'kind': 'window2d', 'rows': 7, 'cols': 7},
                                                                   {'kind': 'global', 'first': 1}]}, 'full_every': 4}"

--data takes a dataset directory written by `omni data fashion-mnist` or `omni data images`
(webdataset shards + manifest.json with class names). --set key=value overrides any config entry.

--set init=PATH starts from a model: an omni export, a timm checkpoint (a hub directory, or a state dict
file with --set init_arch=NAME) or a Hugging Face ViT directory (ViTForImageClassification, or a ViTModel
backbone: a classifier without classes; omni.interop). Its architecture (trunk, patch, pool, channels,
normalisation) replaces this config's; the image size and the classes are this run's: another size resamples its
position table, another class count gets a new head (omni.init.read_init, omni.vision.adapt_classifier). Of
trunk_overrides only ``attention`` applies to it: the model's attention patterns (omni.attention_patterns; without
it a converted peer keeps full attention). A 2-D window on the patch grid with the CLS token global and every 4th
layer full (ViTDet's layout, the example above) pays on the CPU from about 2,048 px: at 1,024 px (4,097 tokens) the
CPU's flash attention is as fast (ViT-Ti/16 fwd + bwd 9.1 CPU-s full, 9.6 windowed), at 2,048 px one windowed layer
costs half a full one (benchmarks/long_images.py). With init use the {'pattern': ..., 'full_every': k} form (a 'layers'
list is checked against this config's trunk before the model is read).
"""

from __future__ import annotations

import sys

from omni.scripts import without_script_folder

sys.path[:] = without_script_folder(sys.path, __file__)  # first: recipes/whisper.py must not hide openai-whisper

import itertools
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from omni.config import FRACTION, NON_EMPTY, POSITIVE, Key, at_least, between, one_of, sets_trunk
from omni.recipe_runtime import rank_zero_first, recipe_config, recipe_parser, run_recipe, train_config
from omni.data.memory import TensorLoader, materialise
from omni.data.reader import ShardLoader
from omni.data.remote import dataset_source
from omni.data.shards import read_manifest
from omni.evaluation import first_batch
from omni.init import read_init
from omni.tokenizers.image import ImageTokenizer
from omni.train import Trainer, process_state, unwrap
from omni.trunk import preset
from omni.vision import (BUILDER, KEEP, BatchAugment, ConvStem, ImageClassifier, adapt_classifier, adapted_trunk,
                         attention_method, image_domain, mixup_cutmix)

# ---------------------------------------------------------------------------------------------------
# Config. Every entry can be overridden with --set key=value.

COMMON = dict(
    data="data/fashion-mnist", out="runs/vit",
    build=Key("fashion-mnist", (str, None), one_of("fashion-mnist"), "build this dataset in `data` if missing"),
    image_size=Key(28, check=at_least(1), help="input images are image_size x image_size pixels"),
    channels=Key(1, check=one_of(1, 3), help="1: grey, 3: RGB"),
    resize=Key(None, (int, None), at_least(1), "None: images already image_size; N: resize the shorter side "
                                                "to N, then crop image_size"),
    train_crop=Key("random", check=one_of("random", "center"),
                   help="with resize, the training crop: 'random' (random-resized crop + flip, ImageNet-style) or "
                        "'center' (as evaluation: resize, centre crop; for framed images such as Fashion-MNIST "
                        "upscaled)"),
    in_memory=Key(True, help="decode the whole split once into tensors (small datasets)"),
    patch=Key(4, check=at_least(1), help="patch size in pixels"), trunk="S",
    trunk_overrides=Key({}, check=sets_trunk(max_positions=("image_size // patch",
                                                            lambda c: c["image_size"] // c["patch"]),
                                             grid=True, longest=("(image_size // patch)^2 patches + the class token",
                                                                 lambda c: (c["image_size"] // c["patch"]) ** 2
                                                                 + (c["pool"] == "cls")))),
    stem=Key(None, (list, None), NON_EMPTY, each=Key(type=int, check=at_least(1)),
             help="channels of a convolutional stem that makes the tokens from the whole image (3x3 convolutions + "
                  "BatchNorm, stride 1 then 2, pooled onto the patch grid; omni.vision.ConvStem); None: patches "
                  "projected"),
    positions="learned", pool=Key("mean", check=one_of("mean", "cls")),
    batch_size=256, epochs=Key(10, (float, None), POSITIVE, "training epochs (unless steps is set)"),
    steps=Key(None, (int, None), help="optimizer steps (None: epochs x steps per epoch)"), lr=1e-3,
    min_lr_ratio=0.01, warmup_epochs=Key(1.0, check=at_least(0)), weight_decay=0.05, clip_norm=1.0, optimizer="adamw",
    label_smoothing=Key(0.1, check=between(0, 0.99)), mixup=Key(0.0, check=at_least(0), help="mixup alpha"),
    cutmix=Key(0.0, check=at_least(0), help="cutmix alpha"), pad=Key(2, check=at_least(0), help="random-crop padding"),
    flip=True, erase_prob=Key(0.25, check=FRACTION, help="random-erasing probability"), workers=2,
    compile=False, eval_every_epochs=Key(1.0, check=at_least(0), help="0: evaluate at the end only"),
    checkpoint_every_epochs=Key(1.0, check=at_least(0), help="0: no checkpoints"), seed=0, progress=True,
    limit_train=None, limit_eval=None, max_corrupt_fraction=0.01, resume="auto",
    init=Key(None, (str, None), help="start from this model: an omni export, a timm or HF ViT checkpoint (module "
                                     "docstring)"),
    init_arch=Key(None, (str, None), help="the timm architecture of a state dict file given as init"),
)
PRESETS: dict[str, dict] = {
    # CPU smoke test: a few steps of a tiny trunk on a slice of the data.
    "tiny": dict(trunk="tiny", patch=7, batch_size=64, steps=30, epochs=None, erase_prob=0.0, out="runs/vit-tiny",
                 warmup_epochs=0.1, lr=3e-3,
                 eval_every_epochs=0, checkpoint_every_epochs=0, limit_train=2048, limit_eval=512),
    # Fashion-MNIST on a 2-core CPU in about six minutes: a convolutional stem (3x3 convs + BatchNorm, 28 -> 14 -> 7
    # -> 4) makes the 4x4 tokens, the hybrid ViT. At equal CPU time the plain 7-px patch projection ends lower
    # (87.9% after 8 epochs against 90.1% after 5; GroupNorm in the stem 3 points below BatchNorm: results.md).
    # Muon on the trunk's matrices (AdamW on the stem, embeddings, head): 5 epochs 89.6% -> 91.7% for +9% CPU;
    # 4.5 epochs (and 3 evaluations) keep the whole command under 6 minutes on 2 cores.
    "fmnist-cpu": dict(trunk="tiny", trunk_overrides=dict(d_model=128, n_layers=4, n_heads=4), patch=7,
                       stem=[16, 32, 64, 64], batch_size=128, epochs=4.5, lr=2e-3, warmup_epochs=0.5, erase_prob=0.0,
                       pad=1, eval_every_epochs=1.5, optimizer="muon"),
    # Fashion-MNIST on one H100: small ViT, patch 4 (7x7 tokens), strong augmentation, many epochs.
    "fmnist": dict(trunk="S", trunk_overrides=dict(d_model=256, n_layers=8, n_heads=8), patch=4, batch_size=512,
                   epochs=150, lr=2e-3, warmup_epochs=5, weight_decay=0.05, label_smoothing=0.1, mixup=0.0,
                   cutmix=0.0, erase_prob=0.25, compile=True, eval_every_epochs=10, checkpoint_every_epochs=25),
    # ImageNet-style 224px training from shards (omni data images), any number of classes.
    "B/16": dict(data=None, build=None, image_size=224, channels=3, resize=256, in_memory=False, patch=16,
                 trunk="B", batch_size=256, epochs=90, lr=1e-3, warmup_epochs=5, weight_decay=0.1, mixup=0.2,
                 cutmix=1.0, pad=0, erase_prob=0.0, workers=12, compile=True, out="runs/vit-b16",
                 eval_every_epochs=1.0, checkpoint_every_epochs=1.0),
}


MISSING = object()


def size_error(size: int, patch: int, what: str) -> str:
    """The one line for an image size the patch does not divide, naming the sizes that fit on either side."""
    below, above = size // patch * patch, (size // patch + 1) * patch
    fit = f"{below} or {above}" if below else f"{above}"
    return (f"image_size {size} must be a multiple of {what}: images are cut into patch x patch squares "
            f"(the nearest that fit: {fit})")


def parse_args(argv=None) -> dict:
    ap = recipe_parser(__doc__, COMMON, PRESETS, "fmnist on CUDA, fmnist-cpu otherwise")
    default = "fmnist" if torch.cuda.is_available() else "fmnist-cpu"
    cfg = recipe_config(ap, ap.parse_args(argv), COMMON, PRESETS, default)
    if cfg["data"] is None:
        ap.error(f"preset {cfg['preset']!r} needs --data DIR (shards from `omni data images`)")
    if cfg["steps"] is None and cfg["epochs"] is None:
        ap.error("set steps or epochs")
    if cfg["init"] is None and cfg["image_size"] % cfg["patch"]:  # an init brings its own patch (checked in main)
        ap.error(size_error(cfg["image_size"], cfg["patch"], f"patch {cfg['patch']}"))
    if cfg["init"]:  # the model brings its trunk: of the overrides only the attention patterns apply to it
        preset_overrides = PRESETS[cfg["preset"]].get("trunk_overrides", {})
        given = sorted(k for k, v in cfg["trunk_overrides"].items()
                       if k != "attention" and preset_overrides.get(k, MISSING) != v)
        if given:
            ap.error(f"trunk_overrides.{given[0]}: init brings its own trunk; with init, trunk_overrides sets only "
                     "attention (the attention patterns)")
    if cfg["stem"]:
        try:
            ConvStem(cfg["channels"], cfg["stem"], cfg["patch"]).check_size(cfg["image_size"], cfg["image_size"])
        except ValueError as exc:
            ap.error(str(exc))
    if cfg["stem"] and cfg["init"]:
        ap.error("init brings its own architecture: set stem or init, not both")
    if cfg["resize"] is not None and cfg["resize"] < cfg["image_size"]:
        ap.error(f"resize {cfg['resize']} must be >= image_size {cfg['image_size']}: the shorter side is resized to "
                 "resize, then an image_size square is cropped from it")
    return cfg


# ---------------------------------------------------------------------------------------------------
# Data


class DecodeImage:
    """Raw shard sample -> (uint8 (C, H, W), label). Picklable for data workers. Resizing / cropping
    uses torchvision v2 transforms per image (random-resized crop + flip for training)."""

    def __init__(self, channels: int, image_size: int, resize: int | None, train: bool, crop: str = "random") -> None:
        self.channels, self.image_size, self.resize, self.train, self.crop = channels, image_size, resize, train, crop
        self._transform = None

    def transform(self):
        if self._transform is None and self.resize is not None:
            from torchvision.transforms import v2

            self._transform = v2.Compose(
                [v2.RandomResizedCrop(self.image_size, antialias=True), v2.RandomHorizontalFlip()]
                if self.train and self.crop == "random"
                else [v2.Resize(self.resize, antialias=True), v2.CenterCrop(self.image_size)])
        return self._transform

    def __call__(self, sample: dict):
        from PIL import Image
        import io

        ext = next((e for e in ("png", "jpg", "jpeg", "webp", "bmp", "ppm", "pgm") if e in sample), None)
        if ext is None or "cls" not in sample:
            raise ValueError(f"sample {sample.get('__key__')!r} has no image or no .cls field")
        image = Image.open(io.BytesIO(sample[ext]))
        image = image.convert("L" if self.channels == 1 else "RGB")
        x = torch.from_numpy(__import__("numpy").asarray(image).copy())
        x = x[None] if x.dim() == 2 else x.permute(2, 0, 1)
        if self.resize is not None:
            x = self.transform()(x)
        elif tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"sample {sample.get('__key__')!r}: image {tuple(x.shape[-2:])}, expected "
                             f"{self.image_size}x{self.image_size} (set resize=... to resize)")
        return x.contiguous(), int(sample["cls"].decode().strip())


def stack(items):
    images, labels = zip(*items)
    return torch.stack(images), torch.tensor(labels)


def fashion_mnist(data: Path) -> None:
    """Build Fashion-MNIST shards in ``data`` unless they are there."""
    if not (data / "manifest.json").is_file():
        from omni.data.builders_vision import build_fashion_mnist

        print(f"building Fashion-MNIST shards in {data} ...", flush=True)
        build_fashion_mnist(out=data)


def build_data(cfg: dict, rank: int, world: int, device: torch.device):
    data = dataset_source(cfg["data"])  # a folder, or a URL the shard reader fetches from (omni.data.remote)
    if isinstance(data, Path):
        if not (data / "manifest.json").is_file() and cfg["build"] != "fashion-mnist":
            raise FileNotFoundError(f"{data}/manifest.json not found: build the dataset with `omni data ...`")
        rank_zero_first(lambda: fashion_mnist(data), rank, world)
    manifest = read_manifest(data, kind="images")
    names = manifest.get("class_names") or manifest.get("classes")
    loaders = {}
    for split, train in (("train", True), ("test" if "test" in manifest["splits"] else "val", False)):
        decode = DecodeImage(cfg["channels"], cfg["image_size"], cfg["resize"], train, cfg["train_crop"])
        limit = cfg["limit_train" if train else "limit_eval"]
        if cfg["in_memory"]:
            chunk = min(1024, limit or 1024)
            once = ShardLoader(data, decode, stack, batch_size=chunk, split=split, rank=0, world_size=1, shuffle=False,
                               num_workers=cfg["workers"] if device.type == "cuda" else 0,
                               max_corrupt_fraction=cfg["max_corrupt_fraction"], kind="images")
            # with a limit, only the batches it keeps are decoded (1,024-px RGB images are 3 MB each)
            images, labels = materialise(itertools.islice(once, math.ceil(limit / chunk)) if limit else once, device)
            if limit:
                images, labels = images[:limit], labels[:limit]
            loaders[split] = TensorLoader([images, labels], cfg["batch_size"], shuffle=train, seed=cfg["seed"],
                                          rank=rank, world_size=world, drop_last=train)
        else:
            loaders[split] = ShardLoader(data, decode, stack, cfg["batch_size"], split=split, rank=rank,
                                         world_size=world, shuffle=train, seed=cfg["seed"],
                                         num_workers=cfg["workers"], drop_last=train,
                                         max_corrupt_fraction=cfg["max_corrupt_fraction"], kind="images")
    train_loader, eval_loader = loaders.values()
    return train_loader, eval_loader, names


# ---------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    state = process_state()
    source = None
    if cfg["init"]:  # the model to start from decides the channels the data is decoded to
        source = read_init(cfg["init"], BUILDER, "recipes/vit.py", "an image classifier (an omni export, a timm or "
                           "Hugging Face ViT checkpoint)", arch=cfg["init_arch"])
        cfg["channels"] = source[2]["image"].channels
        patch = source[2]["image"].patch_size
        if cfg["image_size"] % patch:
            raise ValueError(size_error(cfg["image_size"], patch, f"the patch {patch} of init {cfg['init']}"))
        attention = cfg["trunk_overrides"].get("attention", KEEP)  # absent: the source's (a converted peer: full)
        adapted_trunk(source[0], attention)  # a schedule that does not fit its trunk: one line, before the data
    train_data, eval_data, class_names = build_data(cfg, state.process_index, state.num_processes, state.device)
    n_classes = len(class_names)
    steps_per_epoch = len(train_data)
    steps = cfg["steps"] or math.ceil(cfg["epochs"] * steps_per_epoch)
    every = lambda epochs: max(1, round(epochs * steps_per_epoch)) if epochs else 0  # noqa: E731

    torch.manual_seed(cfg["seed"])
    if source is not None:
        model = adapt_classifier(*source[:2], source[2]["image"], image_size=cfg["image_size"], n_classes=n_classes,
                                 attention=attention)
        image = model.tokenizer
    else:
        image = ImageTokenizer(patch_size=cfg["patch"], channels=cfg["channels"],
                               image_size=cfg["image_size"], policy="resize")
        trunk = preset(cfg["trunk"], positions=cfg["positions"], max_positions=cfg["image_size"] // cfg["patch"],
                       **cfg["trunk_overrides"])
        model = ImageClassifier(image, trunk, n_classes, pool=cfg["pool"], stem=cfg["stem"])
    if getattr(model, "stem", None) is not None and state.num_processes > 1 and state.device.type == "cuda":
        # the stem's BatchNorm then normalises over the global batch, as one process would (SyncBatchNorm needs
        # CUDA; CPU processes normalise over their own share; the state dict keys are the same either way)
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    augment = BatchAugment(pad=cfg["pad"], flip=cfg["flip"], erase_prob=cfg["erase_prob"])

    def loss_fn(model, batch):
        images, labels = batch
        x = augment(images.float() / 255.0)
        x, target = mixup_cutmix(x, labels, n_classes, cfg["mixup"], cfg["cutmix"], cfg["label_smoothing"])
        logits = model(x)
        loss = F.cross_entropy(logits.float(), target)
        return loss, {"accuracy": (logits.argmax(-1) == labels).float().mean()}

    def eval_fn(model, batch):
        images, labels = batch
        logits = model(images)
        return {"accuracy": (logits.argmax(-1) == labels).float(),
                "loss": F.cross_entropy(logits.float(), labels, reduction="none")}

    shown: list = []  # the first eval batch's first 16 images, taken at the first evaluation

    def samples(model, step):
        """TensorBoard: those images with the predicted class and probability over the true one, and the first 4
        under the model's attention rollout with their top-2 classes."""
        from omni.introspect import image_attention
        from omni.plots import Picture, attention_grid, image_grid

        if not shown:  # first_batch leaves the eval loader where it was: evaluations score every batch
            images, labels = first_batch(eval_data)
            shown.extend([images[:16], labels[:16].tolist()])
        probs = model(shown[0]).float().softmax(-1)
        p, predicted = probs.max(-1)
        grid = image_grid(shown[0], shown[1], predicted.tolist(), class_names, probabilities=p.tolist())
        method = attention_method(model, shown[0].shape[-2:])
        # after the grid (only when pictures are drawn), one image at a time: a capture holds (heads, T, T) per layer
        heats = torch.cat([image_attention(model, image[None], method=method) for image in shown[0][:4]])
        top_p, top_c = probs[:4].topk(min(2, n_classes), -1)
        top = [list(zip(c.tolist(), q.tolist())) for c, q in zip(top_c, top_p)]
        label = "attention rollout" if method == "rollout" else "last-layer attention"
        return [Picture("eval/predictions", grid),
                Picture("eval/attention", attention_grid(shown[0][:4], heats, shown[1][:4], top, class_names,
                                                         patch_size=model.patch_size, label=label))]

    config = train_config(cfg, steps=steps, warmup_steps=every(cfg["warmup_epochs"]),
                          eval_every=every(cfg["eval_every_epochs"]),
                          checkpoint_every=every(cfg["checkpoint_every_epochs"]), run_name=f"vit-{cfg['preset']}")
    export = model.export_config(class_names)
    # what the training images look like (background, brightness): omni predict compares a photo with it
    export["image_domain"] = image_domain(first_batch(eval_data)[0])
    if source is not None and "source" in source[0]:  # where the weights came from: omni convert --to reads it
        export["source"] = source[0]["source"]
    trainer = Trainer(model, loss_fn, train_data, config, eval_data=eval_data, eval_fn=eval_fn, samples_fn=samples,
                      hparams=cfg, export_config=export, export_tokenizers={"image": image})
    if state.is_main_process:
        n_params = sum(p.numel() for p in unwrap(trainer.model).parameters())
        print(f"ViT preset {cfg['preset']}: {n_params / 1e6:.2f}M parameters, {steps} steps "
              f"({steps_per_epoch} per epoch), {trainer.accelerator.device}", flush=True)
    start = time.time()
    metrics = trainer.fit()
    if state.is_main_process:
        print(f"done in {time.time() - start:.0f} s: test accuracy {metrics.get('eval/accuracy', float('nan')):.4f} "
              f"(chance {1 / n_classes:.4f}; loss {metrics.get('eval/loss', float('nan')):.4f}, chance "
              f"{math.log(n_classes):.4f}); model exported to {trainer.export_dir}", flush=True)
    return metrics


if __name__ == "__main__":
    run_recipe(main)

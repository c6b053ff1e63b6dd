"""Short-caption retrieval on MS-COCO (5k test) and Flickr30k (1k test), Karpathy splits, 5 captions per image.

Long-CLIP and FineLIP report these to show that long-caption fine-tuning did not cost short-caption retrieval.
Download by hand (the builders' MANUAL_DOWNLOAD_INSTRUCTIONS in hnclip_jax/data/manual.py name every file):
  COCO:      MANUAL_DIR/dataset_coco.json (Karpathy's caption_datasets.zip), MANUAL_DIR/train2014/, MANUAL_DIR/val2014/
  Flickr30k: MANUAL_DIR/dataset_flickr30k.json (same zip), MANUAL_DIR/flickr30k-images/

Check a model fine-tuned on dense captions (the workdir's recorded data is replaced by the --config.data.* flags):
  python eval.py --config configs/coco_flickr.py:coco --workdir /runs/hn \
      --config.data.name=coco --config.data.manual_dir=/data/coco
Fine-tune on them (the paper's Long-CLIP-L recipe, configs/longclip_l.py, with this data and one epoch):
  python train.py --config configs/coco_flickr.py:flickr30k --config.data.manual_dir=/data/flickr30k \
      --config.init_from=/ckpt/longclip-l --workdir /runs/flickr

Eval follows the COCO protocol: text->image counts the image of each of the 25k (5k) query captions;
image->text counts a hit when any of the image's 5 captions is in the top K. eval_results.json records
num_images and num_captions. Training uses one caption per image per step, drawn from config.seed
(hnclip_jax.data.pipeline.caption_choice), so an epoch is one pass over the images.
"""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location("longclip_l", os.path.join(os.path.dirname(__file__), "longclip_l.py"))
longclip_l = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(longclip_l)

TRAIN_IMAGES = {"coco": 113_287, "flickr30k": 29_000}  # Karpathy train (+ restval for COCO)


def get_config(dataset: str = "coco"):
  if dataset not in TRAIN_IMAGES:
    raise ValueError(f"configs/coco_flickr.py: unknown dataset {dataset!r}; choose one of {sorted(TRAIN_IMAGES)}")
  c = longclip_l.get_config("synthetic")
  c.data.name = dataset
  c.data.train_split, c.data.eval_split = "train", "test"
  c.total_steps = TRAIN_IMAGES[dataset] // c.batch_size
  c.checkpoint_every = max(1, c.total_steps // 10)
  c.eval_every = max(1, c.total_steps // 4)
  return c

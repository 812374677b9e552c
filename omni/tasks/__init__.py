"""The task kinds a multitask trunk trains (omni.multitask), one module each, registered by kind name.

A *task* is (name, sampling weight, loss weight, items -> Sample, tokenizers, heads, loss on the packed
batch); its class also says how a recipe scores it (``eval_options``, ``result_row``) and reads a user's
(items, labels) data (``from_items``). ``task_class(kind)`` is the class registered under ``kind``
(``register_task``), as big_vision picks its evaluators by a config ``type``. The built-in kinds:

  classify    ClassifyTask    [x segment] of ANY registered modality (image, or a plug-in such as time series)
                              with a class label -> ClassificationHead (mean-pool over the segment) ->
                              cross-entropy. The label travels as the segment's per-token targets, so it is
                              collated and moved to the device with the batch.
  transcribe  TranscribeTask  [audio segment, text segment "<bos><|transcribe|> ... <eos>"]: the packing rule
                              makes it a prefix-LM (every transcript token sees the whole clip, the clip never
                              sees the text) -> LM head tied to the text embedding -> next-token cross-entropy
                              on the transcript; with ``ctc_weight`` > 0 also a byte-level CTC head on the audio
                              span's hidden states (hybrid CTC/attention, as recipes/whisper.py), its labels
                              carried as the audio segment's targets.
  action      ActionTask      [trajectory segment] (a window of ``context`` steps of an episode, random start)
                              -> ActionHead read at state rows -> cross-entropy (discrete) / MSE (continuous,
                              the tanh output rescaled to the action bounds by ``omni.rl.rescale_actions``).
  lm          LMTask          [text segment] -> the same tied LM head -> next-token cross-entropy.

Pictures (``Task.samples(model)``, gathered by ``task_samples`` into the Trainer's ``samples_fn``): classify gives
its first held-out images with predicted and true labels (image modality), transcribe its first clips (audio and
transcript, or the log-mel and transcript for pre-encoded clips); the other kinds none.

Per-task losses are means over that task's own targets in the batch. Each task's documents are told apart by
``MixedBatch.document_task``, so two tasks may share a modality (ASR transcripts and the text corpus are both
"text").

Held-out metrics (``Task.evaluate(model.omni, ...)``): each kind measures what its single-task recipe
reports, on the task's held-out items, so a jointly trained trunk is compared like for like:

  ClassifyTask   top-1 accuracy (and mean cross-entropy) over every item        (recipes/vit.py)
  TranscribeTask greedy transcripts -> corpus CER / WER (``omni.speech.error_rates``), decoded by
                 ``omni.speech.greedy_decode`` itself (same eos / token-limit / repetition rules) through
                 ``PrefixLMTranscriber``: the audio prefix goes into the trunk's KV cache once
                 (bidirectional over the real frames), then one cached step per token  (recipes/whisper.py);
                 with a CTC head also its best-path CER (``ctc_cer``)
  ActionTask     ``omni.rl.evaluate`` rollouts in the real env through ``TrajectoryPolicy`` (the
                 DecisionTransformer interface over the shared trunk), target = the expert reference,
                 normalised score 100 (R - R_random) / (R_expert - R_random)   (recipes/decision_transformer.py)
  LMTask         token perplexity exp(mean next-token NLL) and bits per UTF-8 byte of the raw text
"""

from omni.tasks.base import TASK_KINDS, NextTextTokenTask, Row, Task, register_task, task_class, task_samples

# isort: off
# (imported, so registered, in the order configs list the kinds in)
from omni.tasks.classify import ClassifyTask
from omni.prefix_lm import PrefixLMTranscriber  # the transcribe task's decoder (a model-level module)
from omni.tasks.transcribe import TranscribeTask
from omni.tasks.action import ActionTask, TrajectoryPolicy
from omni.tasks.lm import LMTask
# isort: on

__all__ = ["ActionTask", "ClassifyTask", "LMTask", "NextTextTokenTask", "PrefixLMTranscriber", "Row", "TASK_KINDS",
           "Task", "TrajectoryPolicy", "TranscribeTask", "register_task", "task_class", "task_samples"]

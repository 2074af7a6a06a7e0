"""Decode steps replayed from CUDA graphs (chapter 07): one capture per batch-size bucket, replayed,
saves a decode step's kernel launches; `capture=False` runs the same buffers eagerly (CPU)."""
# a decode-only step launches the same kernels every time; B requests run in the smallest
# bucket >= B, the rows past B padded

from __future__ import annotations

import torch

from minicb.attention import AttentionMetadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def graph_buckets(max_num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets worth capturing for `max_num_seqs` slots: the slot count caps them."""
    top = min(max_num_seqs, buckets[-1])
    return tuple(sorted({b for b in buckets if b < top} | {top}))


class DecodeGraphRunner:
    """Static input buffers plus one captured graph per bucket."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], page_size: int,
                 max_pages_per_seq: int, device: str | torch.device,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, capture: bool = True) -> None:
        self.model, self.kv_caches, self.page_size = model, kv_caches, page_size
        self.buckets = tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        self.capture_graphs = capture
        n, dev = self.max_batch, torch.device(device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.page_tables = torch.zeros(n, max_pages_per_seq, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self.capture()

    def bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def metadata(self, bucket: int) -> AttentionMetadata:
        return AttentionMetadata.from_tensors(
            self.slot_mapping[:bucket], self.query_start_loc[:bucket + 1],
            self.context_lens[:bucket], self.page_tables[:bucket], query_lens=[1] * bucket,
            context_lens_list=[1] * bucket, num_decodes=bucket, page_size=self.page_size)

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket],
                          self.metadata(bucket), self.kv_caches, self.logits_indices[:bucket])

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up, then capture one graph per bucket (largest first, sharing one memory pool)."""
        pool = None
        for bucket in reversed(self.buckets):
            # warm up outside the capture, on a side stream as PyTorch's recipe does: nothing
            # created lazily may land on the legacy stream the capture cannot see
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slot_mapping: list[int],
            context_lens: list[int], page_tables: list[list[int]]) -> torch.Tensor:
        """Logits [B, vocab] for a decode-only step of B <= max_batch requests."""
        batch = len(input_ids)
        bucket = self.bucket(batch)
        dev = self.input_ids.device
        for buffer, values, padding in ((self.input_ids, input_ids, 0),
                                        (self.positions, positions, 0),
                                        (self.slot_mapping, slot_mapping, -1),
                                        (self.context_lens, context_lens, 0)):
            buffer[:batch] = torch.tensor(values, dtype=buffer.dtype, device=dev)
            buffer[batch:bucket] = padding  # slot -1: the rows past B write no K/V
        width = max(len(t) for t in page_tables)
        rows = torch.tensor([t + [0] * (width - len(t)) for t in page_tables], dtype=torch.int32)
        self.page_tables[:batch, :width] = rows.to(dev)
        if self.capture_graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:batch].clone()
        return self._forward(bucket)[:batch]

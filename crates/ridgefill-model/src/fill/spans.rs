//! Which bulk rows run exactly: spans around the rows the tail's attention scores highest, and
//! the filled rows a sliding-window layer can still reach.

use std::ops::Range;

/// Exact rows inside `bulk`, at most `budget` of them: windows of `2·radius + 1` rows from a
/// little before each best-scoring row onwards ([`window`]), best first, each window adding the
/// rows it does not share with earlier ones; a window that would overrun the budget is passed
/// over. Neighbouring high scores thus widen one span, so a fact sentence the query matches is
/// covered whole, including the words after the match that hold the answer. Where `ends` marks
/// the rows that end a sentence or line (one flag per prompt row; empty: none known), a window
/// with no end after its chosen row runs on to the next one, at most `reach · radius` rows
/// further: a long answer (a UUID) is then copied from exact rows to its last character.
/// Returned sorted and merged.
pub fn choose_spans(
    scores: &[f32],
    bulk: Range<usize>,
    budget: usize,
    radius: usize,
    ends: &[bool],
    reach: usize,
) -> Vec<Range<usize>> {
    choose_new_spans(scores, bulk, &[], budget, radius, ends, reach)
}

/// [`choose_spans`] over a bulk some of whose rows are exact already (`exact`, one flag per
/// position from 0; empty: none, as in a fresh prompt): those rows cost nothing, a window wholly
/// inside them is passed over, and only the rows still filled are returned (a later prefill
/// over a cache whose earlier prompts were filled).
pub fn choose_new_spans(
    scores: &[f32],
    bulk: Range<usize>,
    exact: &[bool],
    budget: usize,
    radius: usize,
    ends: &[bool],
    reach: usize,
) -> Vec<Range<usize>> {
    let is_exact = |i: usize| exact.get(i).copied().unwrap_or(false);
    let filled = bulk.clone().filter(|&i| !is_exact(i)).count();
    let budget = budget.min(filled);
    let mut order: Vec<usize> = bulk.clone().collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut chosen: Vec<bool> = bulk.clone().map(is_exact).collect();
    let mut used = 0;
    for p in order {
        if used == budget {
            break;
        }
        let (behind, ahead) = window(radius);
        let start = p.saturating_sub(behind).max(bulk.start);
        let end = (p + ahead + 1).min(bulk.end);
        let end = sentence_end(ends, p, end, reach * radius, bulk.end);
        let window = start..end;
        let fresh = window.clone().filter(|&i| !chosen[i - bulk.start]).count();
        if fresh == 0 || used + fresh > budget {
            continue;
        }
        window.for_each(|i| chosen[i - bulk.start] = true);
        used += fresh;
    }
    let runs = chosen
        .iter()
        .enumerate()
        .filter(|&(i, c)| *c && !is_exact(bulk.start + i))
        .map(|(i, _)| bulk.start + i..bulk.start + i + 1)
        .collect();
    merge(runs)
}

/// Rows a span takes behind and ahead of its chosen row, `2·radius + 1` in all: mostly ahead,
/// since the tail's attention peaks on the words that match the question and the answer (a
/// number, a UUID) follows them. RULER at 2048 tokens, split 15: multi-value 6 → 47 and
/// multi-query 0 → 41 (full 59, 41) against a centred window of the same width.
fn window(radius: usize) -> (usize, usize) {
    let behind = radius / SPAN_BEHIND_DIVISOR;
    (behind, 2 * radius - behind)
}

/// A span reaches `radius / SPAN_BEHIND_DIVISOR` rows behind its chosen row.
const SPAN_BEHIND_DIVISOR: usize = 4;

/// The end of a window chosen at row `p` and ending before `end`: unchanged when `ends` marks a
/// row in `p..end` (or marks none), else just past the next marked row when one lies within
/// `extra` rows (and before `limit`).
fn sentence_end(ends: &[bool], p: usize, end: usize, extra: usize, limit: usize) -> usize {
    if ends.is_empty() || ends[p..end].contains(&true) {
        return end;
    }
    let cap = (end + extra).min(limit);
    (end..cap).find(|&i| ends[i]).map_or(end, |i| i + 1)
}

/// Filled rows a sliding-window layer needs: those within `window` keys of an exact row
/// (`exact` increasing; the last one is the prompt's last row, so decoding reaches no further
/// back), less the exact rows themselves, whose slots they overwrite.
pub fn window_reads(exact: &[usize], window: usize) -> Vec<Range<usize>> {
    let reach = merge(
        exact
            .iter()
            .map(|&p| (p + 1).saturating_sub(window)..p + 1)
            .collect(),
    );
    let mut out = Vec::new();
    let mut next_exact = exact.iter().peekable();
    for r in reach {
        let mut start = r.start;
        while let Some(&&p) = next_exact.peek() {
            if p >= r.end {
                break;
            }
            if p > start {
                out.push(start..p);
            }
            start = start.max(p + 1);
            next_exact.next();
        }
        if start < r.end {
            out.push(start..r.end);
        }
    }
    out
}

/// Sorts ranges and merges those that overlap or touch.
fn merge(mut spans: Vec<Range<usize>>) -> Vec<Range<usize>> {
    spans.sort_by_key(|s| s.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(spans.len());
    for s in spans {
        match out.last_mut() {
            Some(last) if s.start <= last.end => last.end = last.end.max(s.end),
            _ => out.push(s),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_grow_around_the_best_rows_within_the_budget() {
        let mut scores = vec![0.0f32; 100];
        scores[50] = 9.0;
        scores[52] = 8.0; // near the first: widens its span by two rows
        scores[90] = 7.0; // its window is clipped to the bulk
        scores[3] = 6.0;
        // Radius 4: one row behind each chosen row, seven ahead.
        let spans = choose_spans(&scores, 1..96, 9 + 2 + 7 + 9, 4, &[], 0);
        assert_eq!(spans, vec![2..11, 49..60, 89..96]);
        // A window that would overrun the budget is passed over; smaller ones still fit.
        let spans = choose_spans(&scores, 1..96, 9 + 2, 4, &[], 0);
        assert_eq!(spans, vec![49..60]);
    }

    #[test]
    fn a_matched_sentence_is_covered_to_its_end() {
        // The query matches a sentence's first words best; the answer sits after them.
        let mut scores: Vec<f32> = (0..400).map(|i| ((i * 37 % 101) as f32) * 1e-3).collect();
        for (k, i) in (200..209).enumerate() {
            scores[i] = 1.0 - 0.05 * k as f32;
        }
        // A fixed ±8 window around row 200 would end at 208.
        let answer = 209..214;
        let spans = choose_spans(&scores, 1..384, 5 * 17, 8, &[], 0);
        assert!(
            answer.clone().all(|i| spans.iter().any(|s| s.contains(&i))),
            "{spans:?}"
        );
        let rows: usize = spans.iter().map(|s| s.len()).sum();
        assert!(rows <= 5 * 17, "{rows} rows");
    }

    #[test]
    fn rows_already_exact_cost_nothing_and_are_not_returned() {
        let mut scores = vec![0.0f32; 100];
        scores[20] = 9.0; // inside rows an earlier prefill ran exactly
        scores[60] = 8.0;
        let mut exact = vec![false; 100];
        (18..30).for_each(|i| exact[i] = true);
        // Radius 4: 19..28 lies inside the exact rows; 59..68 costs its 9 rows.
        let spans = choose_new_spans(&scores, 1..96, &exact, 9, 4, &[], 0);
        assert_eq!(spans, vec![59..68]);
        // A window half inside them pays for, and returns, only its filled rows.
        scores[27] = 10.0;
        let spans = choose_new_spans(&scores, 1..96, &exact, 5, 4, &[], 0);
        assert_eq!(spans, vec![30..35]);
    }

    #[test]
    fn a_span_runs_on_to_its_sentence_end() {
        let mut scores = vec![0.0f32; 200];
        scores[50] = 9.0;
        scores[120] = 8.0;
        let mut ends = vec![false; 200];
        // Row 50's sentence ends at 70, past its window (49..58); row 120's inside its own.
        ends[70] = true;
        ends[124] = true;
        // The budget is exactly both spans, so no lower-scoring window fits beside them.
        let spans = choose_spans(&scores, 1..190, 22 + 9, 4, &ends, 4);
        assert_eq!(spans, vec![49..71, 119..128]);
        // A sentence end beyond the reach (4 radii past the window) leaves the window as it is.
        ends[70] = false;
        ends[80] = true;
        let spans = choose_spans(&scores, 1..190, 9 + 9, 4, &ends, 4);
        assert_eq!(spans, vec![49..58, 119..128]);
        // Without the budget for the whole sentence, the window is passed over.
        ends[80] = false;
        ends[70] = true;
        let spans = choose_spans(&scores, 1..190, 21, 4, &ends, 4);
        assert!(spans.contains(&(119..128)), "{spans:?}");
        assert!(!spans.iter().any(|s| s.contains(&50)), "{spans:?}");
    }

    #[test]
    fn a_sliding_layer_fills_only_rows_its_exact_rows_reach() {
        // Sink 0, a span 40..43, tail 96..100, window 8.
        let exact: Vec<usize> = [0].into_iter().chain(40..43).chain(96..100).collect();
        assert_eq!(window_reads(&exact, 8), vec![33..40, 89..96]);
        // A window wider than the prompt reaches every bulk row.
        assert_eq!(window_reads(&exact, 1000), vec![1..40, 43..96]);
        // Window 1: a row sees only itself, so nothing is filled.
        assert!(window_reads(&exact, 1).is_empty());
    }
}

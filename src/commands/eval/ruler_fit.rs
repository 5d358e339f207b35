//! How RULER fits a prompt to its length: the haystack's size is searched (doubling, then
//! bisecting) for the largest prompt whose tokens, with the answer budget, stay within the
//! length. Kept apart from [`super::ruler`]'s generators, which it knows only as a function of
//! the size.

use anyhow::Result;

/// Tokenizes a prompt as the model will see it (BOS included).
pub type Encode<'a> = dyn Fn(&str) -> Result<Vec<u32>> + 'a;
/// Haystack sizes grow to at most this while searching (far beyond any context).
pub const MAX_SIZE: usize = 1 << 24;

/// A prompt built at some size: text, references, tokens.
pub type Built = (String, Vec<String>, Vec<u32>);
/// A prompt generator: haystack size → prompt text and references.
pub type Builder<'b> = dyn Fn(usize) -> Result<(String, Vec<String>)> + 'b;

/// The prompt `build` makes at `size`, if its tokens fit `budget`.
pub fn fitted(
    build: &Builder,
    encode: &Encode,
    budget: usize,
    size: usize,
) -> Result<Option<(usize, Built)>> {
    let (text, refs) = build(size)?;
    let ids = encode(&text)?;
    Ok((ids.len() <= budget).then_some((size, (text, refs, ids))))
}

/// The largest size from `lo` up to `max` (below `hi` when given) whose prompt fits `budget`
/// tokens: doubling until one overflows, then bisecting. `None` when even `lo` overflows.
pub fn largest(
    build: &Builder,
    encode: &Encode,
    budget: usize,
    lo: usize,
    hi: Option<usize>,
    max: usize,
) -> Result<Option<(usize, Built)>> {
    let Some(mut best) = fitted(build, encode, budget, lo)? else {
        return Ok(None);
    };
    let mut hi = match hi {
        Some(h) => h,
        None => loop {
            if best.0 >= max {
                return Ok(Some(best));
            }
            let next = (best.0 * 2).max(best.0 + 1).min(max);
            match fitted(build, encode, budget, next)? {
                Some(fit) => best = fit,
                None => break next,
            }
        },
    };
    // Invariant: `best.0` fits, `hi` does not.
    while hi - best.0 > 1 {
        let mid = best.0 + (hi - best.0) / 2;
        match fitted(build, encode, budget, mid)? {
            Some(fit) => best = fit,
            None => hi = mid,
        }
    }
    Ok(Some(best))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_fitting_size_is_found_from_below_and_above() {
        // BOS, then one token per word: size n takes n + 1 tokens.
        let encode =
            |t: &str| -> Result<Vec<u32>> { Ok(vec![0; 1 + t.split_whitespace().count()]) };
        let build = |n: usize| -> Result<(String, Vec<String>)> { Ok(("w ".repeat(n), vec![])) };
        let size = |lo, hi, max| {
            largest(&build, &encode, 100, lo, hi, max)
                .unwrap()
                .map(|f| f.0)
        };
        assert_eq!(size(1, None, MAX_SIZE), Some(99));
        assert_eq!(size(5, Some(60), MAX_SIZE), Some(59));
        assert_eq!(size(1, None, 40), Some(40));
        assert_eq!(size(100, None, MAX_SIZE), None);
        let fit = fitted(&build, &encode, 100, 99).unwrap().unwrap();
        assert_eq!(fit.1.2.len(), 100);
    }
}

//! Vectors of slots addressed by a `u32` index, freed slots reused first.

/// Put `value` in a free slot of `slots` (from `free`) or a new one; its index.
pub(crate) fn place<T>(slots: &mut Vec<T>, free: &mut Vec<u32>, value: T) -> u32 {
    match free.pop() {
        Some(i) => {
            slots[i as usize] = value;
            i
        }
        None => {
            slots.push(value);
            (slots.len() - 1) as u32
        }
    }
}

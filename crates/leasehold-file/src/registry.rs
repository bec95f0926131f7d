//! Per-name state that lives exactly as long as someone holds a handle to it.
//!
//! A registry maps a lock name to a shared [`Entry`]. Whoever needs the state — a permit
//! holder — keeps an `Arc` of the entry; when the last one is dropped the entry leaves the
//! map. So a process that locks millions of distinct names keeps state
//! only for the names in use right now.

use std::collections::HashMap;
use std::fmt;
use std::ops::Deref;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

type Map<T> = Mutex<HashMap<String, Weak<Entry<T>>>>;

/// Names to their live entries.
pub(crate) struct Registry<T> {
    map: Arc<Map<T>>,
}

/// The state of one name; leaves its registry when the last handle is dropped.
pub(crate) struct Entry<T> {
    name: String,
    map: Weak<Map<T>>,
    value: T,
}

fn lock<T>(map: &Map<T>) -> MutexGuard<'_, HashMap<String, Weak<Entry<T>>>> {
    map.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T> Registry<T> {
    pub(crate) fn new() -> Self {
        Self {
            map: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The entry of `name`, made by `make` if there is none.
    pub(crate) fn get_or_insert_with(&self, name: &str, make: impl FnOnce() -> T) -> Arc<Entry<T>> {
        let mut map = lock(&self.map);
        if let Some(entry) = map.get(name).and_then(Weak::upgrade) {
            return entry;
        }
        // A dead entry still in the map is being dropped; its drop leaves this one alone.
        let entry = Arc::new(Entry {
            name: name.to_owned(),
            map: Arc::downgrade(&self.map),
            value: make(),
        });
        map.insert(name.to_owned(), Arc::downgrade(&entry));
        entry
    }

    /// How many names have state now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.map).len()
    }
}

impl<T> fmt::Debug for Registry<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry")
            .field("names", &lock(&self.map).len())
            .finish()
    }
}

impl<T> Deref for Entry<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T: fmt::Debug> fmt::Debug for Entry<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .field("value", &self.value)
            .finish()
    }
}

impl<T> Drop for Entry<T> {
    fn drop(&mut self) {
        if let Some(map) = self.map.upgrade() {
            let mut map = lock(&map);
            // Only if no newer entry took the name meanwhile.
            if map.get(&self.name).is_some_and(|e| e.strong_count() == 0) {
                map.remove(&self.name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_leaves_with_its_last_handle() {
        let registry = Registry::new();
        let a = registry.get_or_insert_with("a", || 1);
        let again = registry.get_or_insert_with("a", || 2);
        assert_eq!(**again, 1);
        drop(a);
        assert_eq!(registry.len(), 1);
        drop(again);
        assert_eq!(registry.len(), 0);
        assert_eq!(**registry.get_or_insert_with("a", || 3), 3);
    }
}
